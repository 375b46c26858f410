"""cli: the command line checked before Hydra composes, and errors as one line."""

from __future__ import annotations

import sys

import pytest

from transformers_lab.cli import (
    check_flags,
    check_overrides,
    check_run_dir,
    fail,
    group_options,
    keys_named,
    one_line,
    renamed,
    run_dir_folder,
    run_hydra,
    search_dirs,
    user_errors,
)
from transformers_lab.config import CONF_DIR
from transformers_lab.errors import ConfigError, DataFileError


def test_group_options_are_the_yaml_files_of_every_config_dir(tmp_path):
    (tmp_path / "attention").mkdir()
    (tmp_path / "attention" / "mine.yaml").write_text("{}")
    assert "softmax" in group_options("attention")
    assert "mine" not in group_options("attention")
    both = group_options("attention", (CONF_DIR, tmp_path))
    assert "mine" in both and "softmax" in both and both == sorted(both)


def test_search_dirs_reads_searchpath_and_config_dir(tmp_path):
    argv = [f"hydra.searchpath=[file://{tmp_path}/a,'pkg://transformers_lab/x']", "-cd", "b"]
    dirs = search_dirs(argv)
    assert dirs[0] == CONF_DIR and dirs[1] == tmp_path / "a" and dirs[-1].name == "b"
    assert dirs[2].parts[-2:] == ("transformers_lab", "x")
    assert search_dirs(["hydra.searchpath=[pkg://no_such_package_here]"]) is None
    assert search_dirs(["hydra.searchpath=[s3://bucket]"]) is None  # Hydra will say


def test_unknown_options_are_refused_with_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match="unknown attention 'fastmx'; valid options are: .*"):
        check_overrides(["attention=fastmx"])
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        check_overrides(["-m", "model=gpt,nope"])  # each value of a sweep
    (tmp_path / "attention").mkdir()
    (tmp_path / "attention" / "mine.yaml").write_text("{}")
    user = f"hydra.searchpath=[file://{tmp_path}]"
    check_overrides([user, "attention=mine"])  # the user's own option
    check_overrides(["attention=glob(*)", "model.d_model=3", "+attention=null"])
    with pytest.raises(ConfigError, match=r"\(conf/attention/, .*attention/\)"):
        check_overrides([user, "attention=other"])


def test_flags_name_the_override_meant():
    assert keys_named("max_epochs")[0] == "trainer.max_epochs"
    with pytest.raises(ConfigError, match="unknown option --max-epochs.*trainer.max_epochs=5"):
        check_flags(["--max-epochs", "5"])
    check_flags(["-m", "--cfg", "job", "x=1"])  # Hydra's own flags pass


def test_the_run_dir_folder_follows_the_command_line(tmp_path, monkeypatch):
    monkeypatch.setenv("TLAB_ROOT", str(tmp_path))
    assert run_dir_folder([]) == tmp_path / "logs"
    assert str(run_dir_folder(["hydra.run.dir=/a/b"])) == "/a/b"
    assert str(run_dir_folder(["-m", "hydra.sweep.dir='/s/${now:%H}'"])) == "/s"
    assert run_dir_folder(["hydra.run.dir=${paths.log_dir}/x"]) is None
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="cannot create the run dir in .*file/x"):
        check_run_dir([f"hydra.run.dir={tmp_path}/file/x"])
    check_run_dir([f"hydra.run.dir={tmp_path}/new/x"])  # creates nothing
    assert not (tmp_path / "new").exists()


def test_user_errors_become_one_line_and_exit_2(capsys):
    for error in (ConfigError("bad\n  value"), DataFileError("no file")):
        with pytest.raises(SystemExit) as exit_, user_errors():
            raise error
        assert exit_.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: bad value", "error: no file"]
    with pytest.raises(SystemExit):
        fail("x")
    with pytest.raises(KeyError), user_errors():  # a bug is not a user's mistake
        raise KeyError("bug")


def test_renamed_keys_run_under_their_new_names(capsys, monkeypatch):
    argv = ["experiment=mqar", "data.seq_len=64", "+data.task=copy", "data.seq_len=32,64"]
    assert renamed(argv) == [
        "experiment=mqar",
        "data.block_size=64",
        "+data.problem=copy",
        "data.block_size=32,64",
    ]
    err = capsys.readouterr().err
    said = "note: data.seq_len is now called data.block_size; running with data.block_size=64"
    assert said in err
    # the context has one name, block_size: the Transformer's and the translation data's too
    assert renamed(["model.max_len=64", "data.max_len=64", "attention.max_len=64"]) == [
        "model.block_size=64",
        "data.block_size=64",
        "attention.max_len=64",  # cosFormer's own horizon M, not the model's context
    ]
    unchanged = ["data.block_size=8", "model.seq_len=3"]
    assert renamed(unchanged) == unchanged
    # Hydra reads sys.argv: run_hydra puts the new names there
    seen = []
    monkeypatch.setattr(sys, "argv", ["tlab-train", "experiment=mqar", "data.seq_len=64"])
    run_hydra(lambda: seen.append(sys.argv[1:]))
    assert seen == [["experiment=mqar", "data.block_size=64"]]


def test_a_renamed_key_hydra_meets_elsewhere_names_the_new_one():
    """A renamed key that did not come through the command line (a sweep file's params)
    reaches Hydra, whose error names the new key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError

    cfg = OmegaConf.create({"data": {"block_size": 8}})
    OmegaConf.set_struct(cfg, True)
    with pytest.raises(ConfigAttributeError) as caught:
        cfg.data.seq_len  # noqa: B018
    wrapped = RuntimeError("composition failed")
    wrapped.__cause__ = caught.value
    said = "data.seq_len is now called data.block_size: give data.block_size=... instead"
    assert one_line(wrapped) == said


@pytest.mark.parametrize("mistake", ["foo=1", "attention=nope", "trainer.max_step=5"])
def test_tlab_train_refuses_a_bad_key_before_its_heavy_imports(mistake, tmp_path):
    """A key or option that Hydra refuses is refused before torch and Lightning are
    imported (5-6 s on 2 cores; the refusal then takes about 0.5 s, docs/training.md)."""
    import subprocess

    code = (
        "import sys\n"
        "from transformers_lab.train import main\n"
        f"sys.argv = ['tlab-train', {mistake!r}]\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    print('exit', exc.code)\n"
        "heavy = ('torch', 'lightning', 'optuna')\n"
        "print('imported:', sorted(m for m in heavy if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert proc.stderr.startswith("error: "), proc.stderr[-2000:]
    assert "exit 2" in proc.stdout and "imported: []" in proc.stdout, proc.stdout
