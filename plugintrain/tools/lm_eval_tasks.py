"""lm-evaluation-harness tasks, checked before a model loads and run with lm-eval's errors
as one line (issue 47).

lm-eval finds most mistakes of a task YAML only when it scores the first answer: an
``exact_match`` option the metric does not take (``ignore_puncuation: true``) ends a run
in a 25-line traceback from inside lm-eval, after the model loaded and answered every
document. :func:`check_tasks` runs each task through lm-eval's own pipeline first, on one
document, with a stand-in model that answers at once (no model loads), so ``plugintrain
evaluate --tasks`` and the ``Evaluate`` callback refuse such a task before a model loads or
training starts: one line naming the task, lm-eval's own message and the task's YAML.
:func:`run_tasks` reports what lm-eval raises in the real run the same way.

What lm-eval raises is told from a bug of plugintrain by where it was raised: an exception
whose traceback passes through plugintrain's code below lm-eval (the model lm-eval calls)
is plugintrain's and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plugintrain.cli_messages import ConfigError

if TYPE_CHECKING:
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

# plugintrain/: lm-eval reaches plugintrain's code only through the model it is given
# (tools/lm_eval_model.py, or the check's stand-in here), so a bug of plugintrain's that
# lm-eval's frames surround has a frame here, wherever the rest of the package lives.
_PACKAGE = Path(__file__).resolve().parents[1]
_FEWSHOT_SEED = 1234  # simple_evaluate's default fewshot_random_seed


@dataclass(frozen=True)
class CheckedTasks:
    """Tasks lm-eval can build and score, as :func:`check_tasks` found them: what
    :func:`run_tasks` runs.

    Args:
        names: The task, group or tag names, as ``--tasks`` lists them.
        manager: lm-eval's index of the tasks, kept for the run (indexing lm-eval's own
            ~14,700 task files takes seconds).
        include_path: The folder of the user's task YAMLs, or None.
        num_fewshot: Few-shot examples, or None for each task's own.
    """

    names: tuple[str, ...]
    manager: TaskManager
    include_path: str | None = None
    num_fewshot: int | None = None


def check_tasks(
    tasks: Sequence[str],
    include_path: str | None = None,
    num_fewshot: int | None = None,
    *,
    manager: TaskManager | None = None,
) -> CheckedTasks:
    """Check that lm-eval knows, builds and scores each of ``tasks``, without a model.

    Each task is built and run on its first document (with ``num_fewshot`` examples) by
    lm-eval's own ``evaluate``, on a stand-in model, lm-eval's logging and progress bars
    silenced: what lm-eval raises then, it would raise in the run.

    Args:
        tasks: lm-eval task, group or tag names.
        include_path: A folder of the user's own task YAMLs (lm-eval's ``--include_path``).
        num_fewshot: Few-shot examples (None: each task's own).
        manager: lm-eval's ``TaskManager`` to use (default: one built here, of
            ``include_path``'s tasks and, unless every one of ``tasks`` is a task of its
            own, lm-eval's).

    Returns:
        The checked tasks, with the ``TaskManager``, for :func:`run_tasks`.

    Raises:
        ConfigError: One line: lm-eval is not installed; a task it does not know; or
            ``--tasks NAME: lm-eval cannot run it: <lm-eval's message>; fix the task YAML
            in DIR (FILE)``.
    """
    manager = _manager(tasks, include_path) if manager is None else manager
    checked = CheckedTasks(tuple(tasks), manager, include_path, num_fewshot)
    if not checked.names:
        raise ConfigError("--tasks names no task; pass lm-eval's task names, comma-separated")
    for name in checked.names:
        if name not in manager.all_tasks:
            raise ConfigError(_unknown(name, include_path))
    for name in checked.names:
        with _quiet():
            problem = _name_problem(manager, name)
        if problem is not None:
            raise ConfigError(_cannot_run(checked, name, name, problem))
        with _reported(checked, name), _quiet():
            _dry_run(checked, name)
    return checked


def run_tasks(checked: CheckedTasks, model: LM, limit: int | None = None) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of ``checked``'s tasks on ``model``: lm-eval's results.

    Raises:
        ConfigError: What lm-eval raised (not plugintrain's code), in one line naming the
            task where lm-eval's frames tell it.
    """
    import lm_eval

    with _reported(checked, ",".join(checked.names)):
        return lm_eval.simple_evaluate(
            model=model,
            tasks=list(checked.names),
            num_fewshot=checked.num_fewshot,
            limit=limit,
            task_manager=checked.manager,
            log_samples=False,
        )


def _manager(names: Sequence[str], include_path: str | None) -> TaskManager:
    """lm-eval's index of the tasks: ``include_path``'s alone where each of ``names`` is a
    task of its own YAMLs (the full index holds the same entry, as a later path overrides
    lm-eval's, and a task names no other task); else lm-eval's own too (~14,700 files:
    about 12 s here)."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as error:
        raise ConfigError(
            f"--tasks runs lm-evaluation-harness: {error}; pip install lm_eval==0.4.13"
        ) from None
    if include_path is not None:
        own = TaskManager(include_path=include_path, include_defaults=False)
        kinds = {getattr(own.task_index.get(name), "kind", None) for name in names}
        if {getattr(kind, "name", None) for kind in kinds} == {"TASK"}:
            return own
    return TaskManager(include_path=include_path)


def _unknown(name: str, include_path: str | None) -> str:
    """A task lm-eval does not know: where it lists them, and a YAML of ``include_path``
    it skipped for not parsing (lm-eval skips those without a word)."""
    message = (
        f"--tasks {name}: lm-eval knows no such task; `plugintrain lm-eval ls tasks` lists"
        " them (add --include_path for a folder of your own task YAMLs)"
    )
    skipped = None if include_path is None else _unparsed_yaml(Path(include_path))
    return message if skipped is None else f"{message}; lm-eval skipped {skipped}"


def _unparsed_yaml(folder: Path) -> str | None:
    """The first ``*.yaml`` under ``folder`` that is not YAML, with YAML's reason."""
    import yaml

    class AnyTag(yaml.SafeLoader):  # lm-eval's tags (!function) are not the question here
        pass

    AnyTag.add_multi_constructor("!", lambda loader, suffix, node: None)
    for path in sorted(folder.rglob("*.yaml")):
        try:
            yaml.load(path.read_text(), Loader=AnyTag)  # a SafeLoader: builds plain data
        except yaml.MarkedYAMLError as error:
            mark = error.problem_mark
            where = "" if mark is None else f" (line {mark.line + 1}, column {mark.column + 1})"
            what = ", ".join(filter(None, (error.context, error.problem)))
            return f"{path}, which is not YAML: {what}{where}"
        except yaml.YAMLError as error:
            return f"{path}, which is not YAML: {_flat(str(error))}"
    return None


def _name_problem(manager: TaskManager, name: str) -> str | None:
    """A metric or aggregation name in ``name``'s YAML that lm-eval does not have, in its
    registry's words; None if none. lm-eval's own report of one is ``KeyError: None``
    (an unknown metric) or ``'NoneType' object is not callable`` (an unknown aggregation)."""
    import lm_eval.api.metrics  # noqa: F401 (registers lm-eval's metrics)
    from lm_eval.api import registry

    entry = manager.task_index.get(name)
    config = getattr(entry, "cfg", None) or {}
    if "process_results" in config:  # the task scores itself: the metric names are labels
        return None
    for item in config.get("metric_list") or []:
        if not isinstance(item, dict):  # lm-eval's own check says what it should be
            continue
        metric, aggregation = item.get("metric"), item.get("aggregation")
        hf_evaluate = item.get("hf_evaluate") is True
        if _plain(metric) and registry.get_metric(metric, hf_evaluate) is None:
            return _registry_message(registry.metric_registry, metric)
        if _plain(aggregation) and aggregation not in registry.aggregation_registry:
            return _registry_message(registry.aggregation_registry, aggregation)
    return None


def _plain(name: Any) -> bool:
    """A name to look up: a string without a "/" (a ``!function``'s path has one: the
    index leaves them unresolved)."""
    return isinstance(name, str) and "/" not in name


def _registry_message(names: Any, name: str) -> str:
    """lm-eval's registry's message for a name it lacks (with its "Did you mean")."""
    try:
        names.get(name)
    except KeyError as error:
        return _text(error)
    return f"{name} is not available"  # registered by now: lm-eval failed to load it


def _dry_run(checked: CheckedTasks, name: str) -> None:
    """``name`` built and scored on its first document by lm-eval's ``evaluate``, set up
    as ``simple_evaluate`` sets up a task (few-shot count and seed), on a stand-in model
    (``simple_evaluate`` itself would also collect the environment: seconds)."""
    from lm_eval.evaluator import evaluate

    loaded = checked.manager.load([name])
    for task in loaded["tasks"].values():
        default = task.get_config("num_fewshot")
        if checked.num_fewshot is not None and default != 0:
            task.set_config(key="num_fewshot", value=checked.num_fewshot)
        elif checked.num_fewshot is None and default is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=_FEWSHOT_SEED)
    evaluate(lm=_stand_in(), task_dict=loaded, limit=1, bootstrap_iters=0, log_samples=False)


def _stand_in() -> LM:
    """A model that answers every request at once: the lowest log-likelihood of a
    choice, an empty generation (lm-eval is optional, so the class is made here)."""
    from lm_eval.api.model import LM

    class StandIn(LM):
        def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list:
            return [(-1.0, False)] * len(requests)

        def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list:
            return [-1.0] * len(requests)

        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list:
            return [""] * len(requests)

    return StandIn()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """lm-eval's warnings and the progress bars of a check, left out: the run shows them."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _reported(checked: CheckedTasks, requested: str) -> Iterator[None]:
    """What lm-eval raises in the block as one line (ConfigError); plugintrain's own
    exceptions and ConfigError pass through."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as error:
        if _raised_in_plugintrain(error):
            raise
        cause = _first(error)
        task = _failing_task(cause) or requested
        message = _cannot_run(checked, requested, task, _text(cause), cause.__traceback__)
        raise ConfigError(message) from None


def _cannot_run(
    checked: CheckedTasks, requested: str, task: str, message: str, code: Any = None
) -> str:
    """``--tasks NAME: lm-eval cannot run it: MESSAGE; fix the task YAML in DIR (FILE)``;
    ``code``: the traceback of lm-eval's exception, for where the task's own Python raised."""
    who = "it" if task == requested else f"its task {task}"
    line = f"--tasks {requested}: lm-eval cannot run {who}: {message}"
    yaml_path = getattr(checked.manager.task_index.get(task), "yaml_path", None)
    if yaml_path is None:
        return line
    folder = None if checked.include_path is None else Path(checked.include_path).resolve()
    if folder is None or folder not in Path(yaml_path).resolve().parents:
        return f"{line} (lm-eval's own task: {yaml_path})"
    where = Path(yaml_path).resolve().relative_to(folder).as_posix()
    frames = [f for f in traceback.extract_tb(code) if folder in _parents(f)]
    if frames:  # the task's own Python (a !function), where it raised
        where += f"; raised at {Path(frames[-1].filename).name}:{frames[-1].lineno}"
    return f"{line}; fix the task YAML in {checked.include_path} ({where})"


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and every exception it was raised from or while handling."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        exc = todo.pop()
        if id(exc) not in seen:
            seen.add(id(exc))
            yield exc
            todo += [e for e in (exc.__cause__, exc.__context__) if e is not None]


def _first(error: BaseException) -> BaseException:
    """The exception whose message matters: for one raised while handling another (and
    not ``from`` it), the one handled. lm-eval retries a metric that raised TypeError with
    other arguments: ``exact_match_fn() takes 0 positional arguments`` hides
    ``got an unexpected keyword argument 'ignore_puncuation'``."""
    while error.__cause__ is None and error.__context__ is not None:
        if error.__suppress_context__:
            break
        error = error.__context__
    return error


def _raised_in_plugintrain(error: BaseException) -> bool:
    """Whether ``error`` is plugintrain's: raised by plugintrain's code before it called
    into lm-eval (no frame of lm-eval's), or by plugintrain's code lm-eval called (a frame
    of plugintrain's below lm-eval's first; in an exception of the chain, any)."""
    import lm_eval

    lm_eval_folder = Path(lm_eval.__file__).resolve().parent
    frames = traceback.extract_tb(error.__traceback__)
    entry = next((i for i, f in enumerate(frames) if lm_eval_folder in _parents(f)), None)
    if entry is None or any(_PACKAGE in _parents(f) for f in frames[entry:]):
        return True
    chained = itertools.islice(_chain(error), 1, None)
    return any(
        _PACKAGE in _parents(f) for exc in chained for f in traceback.extract_tb(exc.__traceback__)
    )


def _parents(frame: traceback.FrameSummary) -> list[Path]:
    return list(Path(frame.filename).resolve().parents)


def _failing_task(error: BaseException) -> str | None:
    """The task lm-eval was building or scoring when it raised: the innermost frame of a
    method of a task that has its configuration."""
    from lm_eval.api.task import Task

    tb = error.__traceback__
    names = []
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        config = getattr(owner, "_config", None) if isinstance(owner, Task) else None
        if isinstance(getattr(config, "task", None), str):
            names.append(config.task)
        tb = tb.tb_next
    return names[-1] if names else None


def _text(error: BaseException) -> str:
    """``Type: message`` on one line, as Python's last traceback line shows it (a
    KeyError's sentence without the quotes of its repr)."""
    args = error.args
    sentence = isinstance(error, KeyError) and len(args) == 1 and isinstance(args[0], str)
    text = _flat(args[0] if sentence and " " in args[0] else str(error))
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _flat(text: str) -> str:
    return " ".join(text.split())
