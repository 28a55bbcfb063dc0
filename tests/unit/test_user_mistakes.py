"""Mistakes a user makes on the command line, each answered by one line naming the setting, the
value and what to do (exit code 2), never a traceback: a bad --tables-json or an impossible table
for serve-ps, an empty config, a directory as the data path, a file as the output directory, and
learning rates that make the loss diverge."""
import json

import pytest
import yaml

from hybridrec.cli import main
from hybridrec.ps.server import main as server_main
from helpers import SMALL


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    return err.splitlines()[-1]


@pytest.mark.parametrize("argv, says", [
    (["--tables-json", "{bad"], "--tables-json is not valid JSON"),
    (["--tables-json", "[1]"], "--tables-json must be an object of table name -> object of its fields"),
    (["--tables-json", '{"u": {"dim": 8}}'], "table 'u': "),
    (["--table", "user:1024:2000000000"], "the tables' rows alone need 15258.8 GiB, more than this machine's"),
])
def test_serve_ps_table_mistakes_exit_2_with_one_line(capsys, argv, says):
    with pytest.raises(SystemExit) as info:
        server_main(argv)
    assert info.value.code == 2 and says in one_line_error(capsys)


def test_an_empty_config_is_refused(tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    assert main(["train", str(empty)]) == 2
    assert "the config is empty" in one_line_error(capsys)
    assert not (tmp_path / "runs").exists()


def _job(tmp_path, **train) -> str:
    job = json.loads(json.dumps(SMALL))
    job["train"].update({"output_dir": str(tmp_path / "run"), **train})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def test_a_directory_as_data_path_and_a_file_as_output_dir_are_named(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    assert main(["train", _job(tmp_path), "--set", "data.format=criteo", "--set", f"data.path={tmp_path / 'data'}",
                 "--set", "data.test_fraction=0.1"]) == 2
    assert f"data.path: '{tmp_path / 'data'}' is a directory; name its data files" in one_line_error(capsys)
    (tmp_path / "taken").write_text("a file")
    assert main(["train", _job(tmp_path), "--set", f"train.output_dir={tmp_path / 'taken' / 'run'}"]) == 2
    assert f"'{tmp_path / 'taken'}' is a file, not a directory" in one_line_error(capsys)


def test_a_diverging_loss_names_its_step_and_the_optimizer_settings(tmp_path, capsys):
    code = main(["train", _job(tmp_path, dense_optimizer={"name": "adam", "lr": 1e30}), "--set", "train.max_steps=20"])
    assert code == 2
    line = one_line_error(capsys)
    assert "training diverged at step" in line and "train.dense_optimizer (adam, lr 1e+30" in line
    assert "embedding.default.optimizer (adagrad, lr 0.1)" in line
