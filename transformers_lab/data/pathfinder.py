"""LRA's Pathfinder generator (Linsley et al., 2018; Kim et al., 2020): a 32x32 image holds
two long dashed paths and short distractors; two markers lie either on the two ends of one
path (label 1) or on one end of each long path (label 0). LRA reads the image as 1,024
8-bit pixel tokens. Its data came from Linsley's generator with, at 32x32 (LRA's
``lra_benchmarks/data/pathfinder.py``): paddles of 2 pixels with a margin of 1, markers of
radius 1.5, markers at least 7 pixels apart, distractors a third of the path's length, 20 //
that many of them, and splits easy, intermediate and hard of paths 6, 9 and 14 paddles long.

This generator is our own on those rules: a path is a walk of dashes (``dash`` pixels
drawn, ``gap`` left blank, turning by at most ``max_turn`` radians between dashes) and
different paths keep more than ``gap + 1`` pixels apart, so that "joined" is exactly "one
component when pixels up to ``gap + 1`` apart (Chebyshev) touch": a flood fill over the
pixels gives the label back. Plain Python from a seed; ``lra.PathfinderDataModule`` reads
the images as tensors.
"""

from __future__ import annotations

import math
import random

PATHFINDER_SPLITS = {"easy": 6, "intermediate": 9, "hard": 14}  # dashes of a path
PATH_LEVEL, MARKER_LEVEL = 191, 255  # 8-bit intensities: LRA's paddle contrast 0.75, markers 1
Pixel = tuple[int, int]


def near(pixels: set[Pixel], radius: int) -> set[Pixel]:
    """The pixels within Chebyshev distance ``radius`` of ``pixels``."""
    span = range(-radius, radius + 1)
    return {(y + dy, x + dx) for y, x in pixels for dy in span for dx in span}


class PathCanvas:
    """One Pathfinder image while it is drawn: each path's pixels, kept more than
    ``reach = gap + 1`` pixels (Chebyshev) from every other path's."""

    def __init__(self, size: int, dash: int, gap: int, max_turn: float, rng: random.Random):
        self.size, self.dash, self.gap, self.max_turn, self.rng = size, dash, gap, max_turn, rng
        self.reach = gap + 1
        self.paths: list[set[Pixel]] = []
        self.blocked: set[Pixel] = set()  # within reach of a path drawn already

    def inside(self, pixel: Pixel, margin: int = 1) -> bool:
        return all(margin <= c < self.size - margin for c in pixel)

    def walk(
        self, dashes: int, marked: bool = False, tries: int = 50
    ) -> tuple[set[Pixel], Pixel, Pixel] | None:
        """A path of ``dashes`` dashes clear of the others: (pixels, first end, last end),
        or None when ``tries`` random starts all ran into a border or another path.
        ``marked``: its ends need room for markers (3x3 squares) clear of the others too."""
        for _ in range(tries):
            y, x = (self.rng.uniform(2, self.size - 3) for _ in range(2))
            angle = self.rng.uniform(0, 2 * math.pi)
            drawn: list[Pixel] = []
            ok = True
            for d in range(dashes):
                dash = self.next_dash(y, x, angle, first=not d)
                if dash is None:
                    ok = False
                    break
                y, x, angle, pixels = dash
                drawn += pixels
            if ok and marked:  # room for a marker on either end, clear of the others
                room = near({drawn[0], drawn[-1]}, 1)
                ok = all(self.inside(p, 0) for p in room) and not room & self.blocked
            if ok:
                return set(drawn), drawn[0], drawn[-1]
        return None

    def next_dash(
        self, y: float, x: float, angle: float, first: bool, turns: int = 8
    ) -> tuple[float, float, float, list[Pixel]] | None:
        """The next dash from (y, x): a turn of at most ``max_turn`` (none for the first),
        ``gap`` blank steps then ``dash`` drawn ones, inside the border and clear of the
        other paths; up to ``turns`` turns are tried. Returns where it ends, its angle
        and its pixels, or None."""
        for _ in range(1 if first else turns):
            turned = angle if first else angle + self.rng.uniform(-self.max_turn, self.max_turn)
            dy, dx = math.sin(turned), math.cos(turned)
            steps = range(self.dash) if first else range(self.gap + 1, self.gap + 1 + self.dash)
            pixels = [(round(y + s * dy), round(x + s * dx)) for s in steps]
            if all(self.inside(p) and p not in self.blocked for p in pixels):
                last = steps[-1]
                return y + last * dy, x + last * dx, turned, pixels
        return None

    def add(self, pixels: set[Pixel], room: set[Pixel] = frozenset()) -> None:
        """Draw a path; ``room`` (its markers' squares) is kept clear of later paths too."""
        self.paths.append(pixels)
        self.blocked |= near(pixels | room, self.reach)


def pathfinder_image(
    rng: random.Random,
    label: int,
    size: int = 32,
    dashes: int = 14,
    distractors: int | None = None,
    distractor_dashes: int | None = None,
    dash: int = 2,
    gap: int = 1,
    max_turn: float = math.pi / 4,
    marker_distance: int = 7,
) -> tuple[list[list[int]], list[Pixel]] | None:
    """One image (``size`` rows of 8-bit pixels) and its two markers' centres, or None when
    the paths did not fit (the caller draws again).

    Two paths of ``dashes`` dashes, then ``distractors`` (LRA: 20 // their length) paths of
    ``distractor_dashes`` (LRA: a third of ``dashes``). Markers (3x3 squares) sit on the ends
    of the first path (``label`` 1) or on an end of each (``label`` 0), at least
    ``marker_distance`` pixels apart (Euclidean) either way."""
    distractor_dashes = distractor_dashes or max(1, dashes // 3)
    distractors = 20 // distractor_dashes if distractors is None else distractors
    canvas = PathCanvas(size, dash, gap, max_turn, rng)
    ends = []
    for _ in range(2):
        found = canvas.walk(dashes, marked=True)
        if found is None:
            return None
        pixels, first, last = found
        ends.append((first, last))
        canvas.add(pixels, room=near({first, last}, 1))
    markers = list(ends[0]) if label else [ends[0][rng.randrange(2)], ends[1][rng.randrange(2)]]
    if math.dist(*markers) < marker_distance:
        return None
    for _ in range(distractors):
        found = canvas.walk(distractor_dashes)
        if found is not None:
            canvas.add(found[0])
    image = [[0] * size for _ in range(size)]
    for pixels in canvas.paths:
        for y, x in pixels:
            image[y][x] = PATH_LEVEL
    for y, x in near(set(markers), 1):
        image[y][x] = MARKER_LEVEL
    return image, markers
