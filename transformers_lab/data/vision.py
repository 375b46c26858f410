"""Image classification data: MNIST and Fashion-MNIST (torchvision), scikit-learn digits;
each as images, or read as sequences of pixel tokens (``as_sequence``: LRA's Image task
reads CIFAR-10 so; MNIST's 784 pixels are the nearest task offline). ``pixel_side`` averages
the image down to a smaller square first (MNIST at 14: 196 tokens), a CPU-scale cut."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset, random_split

from transformers_lab.data.base import DataModule, ResumableLoader
from transformers_lab.data.download import data_root, ensure_file
from transformers_lab.errors import DataFileError, at_least

# Archives and checksums: MNIST by sha256; Fashion-MNIST by the MD5s torchvision pins.
MNIST_MIRROR = "https://ossci-datasets.s3.amazonaws.com/mnist/"
MNIST_FILES = {
    "train-images-idx3-ubyte.gz": "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",  # noqa: E501
    "train-labels-idx1-ubyte.gz": "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",  # noqa: E501
    "t10k-images-idx3-ubyte.gz": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    "t10k-labels-idx1-ubyte.gz": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
}
FASHION_MIRROR = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
FASHION_FILES = {
    "train-images-idx3-ubyte.gz": "md5:8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "train-labels-idx1-ubyte.gz": "md5:25c81989df183df01b3e8a0aad5dffbe",
    "t10k-images-idx3-ubyte.gz": "md5:bef4ecab320f06d8554ea6380940ec79",
    "t10k-labels-idx1-ubyte.gz": "md5:bb300cfdad3c16e7a12a480ee83cd310",
}


PIXEL_LEVELS = 256  # a pixel token is its 8-bit intensity, as LRA's Image task reads pixels


class PixelTokens:
    """An image of intensities in [0, 1] (C, H, W) as its pixels' 8-bit intensities, row
    by row (H * W,): the sequence an encoder over tokens reads (``as_sequence``). With
    ``side`` the image is first averaged down to side x side (areas averaged: MNIST's
    28 to 14 averages each 2x2 block)."""

    def __init__(self, side: int | None = None) -> None:
        self.side = side

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        gray = image.mean(0, keepdim=True)
        if self.side is not None and self.side != gray.shape[-1]:
            gray = F.adaptive_avg_pool2d(gray, self.side)
        return (gray[0] * (PIXEL_LEVELS - 1)).round().long().flatten()


class ImageDataModule(DataModule):
    """Loaders and model facts shared by the image data modules: subclasses fill
    ``train_set``, ``val_set`` and ``test_set`` in ``setup``. With ``as_sequence`` an
    example is the image's pixels as tokens (``PixelTokens``) for a model over tokens,
    averaged down to ``pixel_side`` x ``pixel_side`` first when that is given."""

    image_size: int
    in_channels: int
    num_classes: int

    def __init__(
        self,
        batch_size: int = 64,
        num_workers: int = 0,
        as_sequence: bool = False,
        pixel_side: int | None = None,
    ) -> None:
        super().__init__()
        at_least(1, batch_size=batch_size)
        at_least(0, num_workers=num_workers)
        if pixel_side is not None:
            if not as_sequence:
                raise ValueError(
                    f"pixel_side={pixel_side} sets the side of the image read as pixel "
                    "tokens; it needs as_sequence=true (or leave pixel_side null)"
                )
            at_least(1, pixel_side=pixel_side)
            if pixel_side > self.image_size:
                raise ValueError(
                    f"pixel_side={pixel_side} must be between 1 and the image's side "
                    f"{self.image_size} (the image is averaged down to it, never up)"
                )
        self.batch_size, self.num_workers = batch_size, num_workers
        self.as_sequence, self.pixel_side = as_sequence, pixel_side
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    def model_keys(self) -> set[str]:
        if self.as_sequence:
            return {"vocab_size", "block_size", "num_classes"}
        return {"image_size", "in_channels", "num_classes"}

    def model_kwargs(self) -> dict[str, int]:
        """What a classifier needs from this data: the image's geometry, or with
        ``as_sequence`` the pixel vocabulary and the sequence's length."""
        if self.as_sequence:
            return {
                "vocab_size": PIXEL_LEVELS,
                "block_size": (self.pixel_side or self.image_size) ** 2,
                "num_classes": self.num_classes,
            }
        return {
            "image_size": self.image_size,
            "in_channels": self.in_channels,
            "num_classes": self.num_classes,
        }

    def _loader(self, name: str, shuffle: bool = False) -> DataLoader:
        if getattr(self, name) is None:
            self.setup()
        loader = ResumableLoader if shuffle else DataLoader  # shuffled: the training split
        return loader(
            getattr(self, name),
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train_set", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val_set")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test_set")


class MNISTDataModule(ImageDataModule):
    """MNIST through torchvision: 60000 training images (the last ``val_size`` held out
    for validation) and the 10000 test images, normalised by the training mean and std.

    The archives live in ``<root>/MNIST/raw/``; missing ones are downloaded and checked
    against pinned checksums. ``augment`` adds random shifts of up to 2 pixels;
    ``as_sequence`` reads each image as its 784 pixel tokens (unnormalised 8-bit values),
    or ``pixel_side``² of them from the image averaged down to that side.
    """

    folder, mirror, files = "MNIST", MNIST_MIRROR, MNIST_FILES
    mean, std = 0.1307, 0.3081
    image_size, in_channels, num_classes = 28, 1, 10

    def __init__(
        self,
        root: str | None = None,
        batch_size: int = 64,
        val_size: int = 5000,
        augment: bool = False,
        num_workers: int = 0,
        download: bool = True,
        as_sequence: bool = False,
        pixel_side: int | None = None,
    ) -> None:
        super().__init__(batch_size, num_workers, as_sequence, pixel_side)
        at_least(0, val_size=val_size)
        self.root, self.val_size = data_root(root), val_size
        self.augment, self.download = augment, download

    def prepare_data(self) -> None:
        """Fetch and verify the archives, and unpack them once (on one process)."""
        raw = self.root / self.folder / "raw"
        for name, checksum in self.files.items():
            ensure_file(raw / name, self.mirror + name, checksum, download=self.download)
        for train in (True, False):  # torchvision unpacks verified archives, no download
            try:
                self._dataset(train, augment=False, unpack=True)
            except PermissionError as exc:  # a shared, read-only copy of the archives
                raise DataFileError(
                    f"{self.folder}'s archives in {raw} are unpacked once beside them, but "
                    f"{exc.filename or raw} cannot be written ({exc.strerror}); unpack them "
                    f"there (gunzip -k {raw}/*.gz), or point TLAB_DATA_DIR (or data.root=) at "
                    "a folder you can write that holds a copy"
                ) from None

    def _dataset(self, train: bool, augment: bool, unpack: bool = False) -> Dataset:
        from torchvision import datasets, transforms

        steps = [transforms.RandomAffine(0, translate=(2 / 28, 2 / 28))] if augment else []
        steps.append(transforms.ToTensor())
        # pixel tokens are the raw intensities; images are normalised by the training set's
        normalise = transforms.Normalize((self.mean,), (self.std,))
        steps.append(PixelTokens(self.pixel_side) if self.as_sequence else normalise)
        cls = datasets.FashionMNIST if self.folder == "FashionMNIST" else datasets.MNIST
        return cls(self.root, train=train, download=unpack, transform=transforms.Compose(steps))

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        try:
            full, plain = self._dataset(True, self.augment), self._dataset(True, False)
        except RuntimeError:  # torchvision's "Dataset not found"
            raise DataFileError(
                f"{self.folder} is not unpacked under {self.root / self.folder / 'raw'}; call "
                "prepare_data() first (the Trainer does) to fetch and unpack the archives"
            ) from None
        n_train = len(full) - self.val_size
        self.train_set = torch.utils.data.Subset(full, range(n_train))
        self.val_set = torch.utils.data.Subset(plain, range(n_train, len(plain)))
        self.test_set = self._dataset(False, False)


class FashionMNISTDataModule(MNISTDataModule):
    """Fashion-MNIST (Xiao et al., 2017): the MNIST layout with clothing images."""

    folder, mirror, files = "FashionMNIST", FASHION_MIRROR, FASHION_FILES
    mean, std = 0.2860, 0.3530


class DigitsDataModule(ImageDataModule):
    """scikit-learn's bundled 8x8 digits (1797 images, no download), scaled to [0, 1] and
    split at random (fixed ``seed``) into train, validation and test."""

    image_size, in_channels, num_classes = 8, 1, 10

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        seed: int = 0,
        num_workers: int = 0,
        as_sequence: bool = False,
        pixel_side: int | None = None,
    ) -> None:
        super().__init__(batch_size, num_workers, as_sequence, pixel_side)
        if not (0 < val_fraction < 1 and 0 <= test_fraction < 1):
            raise ValueError(
                f"val_fraction={val_fraction} must be in (0, 1) and test_fraction="
                f"{test_fraction} in [0, 1)"
            )
        if val_fraction + test_fraction >= 1:
            raise ValueError(
                f"val_fraction={val_fraction} + test_fraction={test_fraction} leave no "
                "training images; make their sum less than 1"
            )
        self.val_fraction, self.test_fraction, self.seed = val_fraction, test_fraction, seed

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        if self.as_sequence:
            read = PixelTokens(self.pixel_side)
            images = torch.stack([read(image) for image in images])
        labels = torch.tensor(digits.target, dtype=torch.long)
        full = TensorDataset(images, labels)
        n_val = int(len(full) * self.val_fraction)
        n_test = int(len(full) * self.test_fraction)
        sizes = [len(full) - n_val - n_test, n_val, n_test]
        generator = torch.Generator().manual_seed(self.seed)
        self.train_set, self.val_set, self.test_set = random_split(full, sizes, generator)
