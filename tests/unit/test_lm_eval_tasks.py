"""A task YAML lm-evaluation-harness cannot run is one line naming the task, lm-eval's own
message and the YAML, before a model loads (issue 47): ``check_tasks`` builds each task and
scores its first document through lm-eval with a stand-in model. ``plugintrain evaluate
--tasks`` calls it, and so does the ``Evaluate`` callback. Without a model; a folder's own
tasks need no index of lm-eval's (~14,700 task files, about 12 s)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plugintrain.cli import main
from plugintrain.cli_messages import ConfigError, unknown_option

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.model import LM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from plugintrain.tools import lm_eval_tasks  # noqa: E402
from plugintrain.tools.lm_eval_tasks import check_tasks, run_tasks  # noqa: E402

ANSWERS = {"What is the capital of France?": "Paris", "2 + 2 =": "4", "Which animal barks?": "dog"}
# A new user's exact_match option: lm-eval's is ignore_punctuation.
TYPO = "  - metric: exact_match\n    ignore_puncuation: true\n"


def _task(folder: Path, name: str, metric: str = "  - metric: exact_match\n") -> Path:
    """A generate-until task of three questions, as JSON lines and YAML: its YAML."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = "".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in ANSWERS.items())
    (folder / "qa.jsonl").write_text(rows)
    yaml = folder / f"{name}.yaml"
    yaml.write_text(
        f"task: {name}\ndataset_path: json\ntest_split: train\n"
        f"dataset_kwargs:\n  data_files:\n    train: {folder / 'qa.jsonl'}\n"
        'output_type: generate_until\ndoc_to_text: "Q: {{question}}\\nA:"\n'
        'doc_to_target: "{{answer}}"\ngeneration_kwargs:\n  until: ["\\n"]\n'
        f"metric_list:\n{metric}"
    )
    return yaml


def _check(folder: Path, name: str) -> lm_eval_tasks.CheckedTasks:
    checked = check_tasks([name], str(folder))
    assert "hellaswag" not in checked.manager.all_tasks  # the folder's own tasks indexed
    return checked


class Answers(LM):
    """Each question's answer with a full stop: an exact match only when punctuation is
    ignored."""

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list:
        raise NotImplementedError

    loglikelihood_rolling = loglikelihood

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        return [f"{ANSWERS[r.args[0][3:-3]]}." for r in requests]


def test_an_option_exact_match_does_not_take_is_one_line_and_the_fix_runs(
    tmp_path: Path,
) -> None:
    _task(tmp_path, "qa", TYPO)
    with pytest.raises(ConfigError) as refused:
        _check(tmp_path, "qa")
    assert str(refused.value) == (
        "--tasks qa: lm-eval cannot run it: TypeError: exact_match_hf_evaluate() got an"
        " unexpected keyword argument 'ignore_puncuation'; fix the task YAML in"
        f" {tmp_path} (qa.yaml)"
    )
    fixed = tmp_path / "qa.yaml"  # the file the line names, the option spelled as lm-eval's
    fixed.write_text(fixed.read_text().replace("ignore_puncuation", "ignore_punctuation"))
    results = run_tasks(_check(tmp_path, "qa"), Answers())
    assert results["results"]["qa"]["exact_match,none"] == 1.0  # "Paris." is "Paris"


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("generate_until", "generate", "ValueError: Got invalid output_type 'generate'"),
        ("{{question}}", "{{question}", "TemplateSyntaxError: unexpected '}'"),
        ("{{question}}", "{{questoin}}", "UndefinedError: 'questoin' is undefined"),
        ("qa.jsonl", "qa.json", "FileNotFoundError: Unable to find"),
        ("doc_to_text", "doc_to_txt", "unexpected keyword argument 'doc_to_txt'"),
        ("exact_match\n", "exact_match\n    aggregation: avg\n", "Unknown aggregation 'avg'"),
        ("exact_match\n", "exact_match\n    regexes_to_ignore: 5\n", "'int' object is not"),
    ],
)  # fmt: skip
def test_yaml_lm_eval_cannot_run_is_one_line(
    tmp_path: Path, old: str, new: str, message: str
) -> None:
    yaml = _task(tmp_path, "qa")
    yaml.write_text(yaml.read_text().replace(old, new, 1))
    with pytest.raises(ConfigError) as refused:
        _check(tmp_path, "qa")
    line = str(refused.value)
    assert "\n" not in line and line.startswith("--tasks qa: lm-eval cannot run it: ")
    assert message in line and line.endswith(f"; fix the task YAML in {tmp_path} (qa.yaml)")


def test_a_yaml_that_does_not_parse_is_named(tmp_path: Path) -> None:
    """lm-eval skips it without a word; the task is then one it does not know."""
    yaml = _task(tmp_path, "qa")
    yaml.write_text(yaml.read_text().replace("output_type: generate_until", "output_type: ["))
    own = TaskManager(include_path=str(tmp_path), include_defaults=False)  # as the full one
    with pytest.raises(ConfigError) as refused:
        check_tasks(["qa"], str(tmp_path), manager=own)
    assert str(refused.value).startswith("--tasks qa: lm-eval knows no such task; ")
    assert str(refused.value).endswith(
        f"; lm-eval skipped {yaml}, which is not YAML: while parsing a flow sequence, expected"
        " ',' or ']', but got '<scalar>' (line 9, column 1)"
    )


def test_the_tasks_own_python_is_located(tmp_path: Path) -> None:
    (tmp_path / "utils.py").write_text("def score(doc, results):\n    return {'x': doc['answr']}\n")
    yaml = _task(tmp_path, "qa")
    yaml.write_text(yaml.read_text() + "process_results: !function utils.score\n")
    with pytest.raises(ConfigError) as refused:
        _check(tmp_path, "qa")
    assert str(refused.value) == (
        "--tasks qa: lm-eval cannot run it: KeyError: 'answr'; fix the task YAML in"
        f" {tmp_path} (qa.yaml; raised at utils.py:2)"
    )


def test_what_fails_past_the_first_document_is_one_line_in_the_run(tmp_path: Path) -> None:
    """The check scores one document; the run reports a later one's failure the same way."""
    yaml = _task(tmp_path, "qa")
    later = "{{question if question|length > 8 else nothing.at_all}}"
    yaml.write_text(yaml.read_text().replace("{{question}}", later))
    checked = _check(tmp_path, "qa")
    with pytest.raises(ConfigError) as refused:
        run_tasks(checked, Answers())
    assert str(refused.value) == (
        "--tasks qa: lm-eval cannot run it: UndefinedError: 'nothing' is undefined; fix the"
        f" task YAML in {tmp_path} (qa.yaml)"
    )


def test_a_bug_of_plugintrain_keeps_its_traceback(tmp_path: Path, monkeypatch) -> None:
    """An exception raised in plugintrain's code that lm-eval calls is not lm-eval's."""

    class Broken(Answers):
        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
            return [unknown_option("--x", None)]  # plugintrain's code, raising TypeError

    monkeypatch.setattr(lm_eval_tasks, "_stand_in", Broken)
    _task(tmp_path, "qa")
    with pytest.raises(TypeError) as raised:
        _check(tmp_path, "qa")
    assert type(raised.value) is TypeError and "NoneType" in str(raised.value)


def test_evaluate_tasks_refuses_before_the_model_loads(tmp_path: Path, capfd) -> None:
    """One line on stderr, exit status 2: the weights are not even a checkpoint."""
    _task(tmp_path / "tasks", "qa", TYPO)
    (tmp_path / "weights.ckpt").write_bytes(b"")
    argv = ["evaluate", "--weights", str(tmp_path / "weights.ckpt"), "--tasks", "qa",
            "--include_path", str(tmp_path / "tasks")]  # fmt: skip
    capfd.readouterr()
    assert main(argv) == 2
    out, err = capfd.readouterr()
    assert out == "" and err == (
        "plugintrain evaluate: error: --tasks qa: lm-eval cannot run it: TypeError:"
        " exact_match_hf_evaluate() got an unexpected keyword argument 'ignore_puncuation';"
        f" fix the task YAML in {tmp_path / 'tasks'} (qa.yaml)\n"
    )
