"""TRL 1.16's preference losses, the independent reference of plugintrain's (issue 45).

:func:`trl_step` runs one batch of tokenized pairs through a TRL trainer's own collator and
``compute_loss`` (``DPOTrainer`` for the DPO family, ``CPOTrainer`` for SimPO,
``ORPOTrainer`` for ORPO) on CPU in float32, then ``loss.backward()``; :func:`trl_train`
runs the trainer's own ``train()`` for a few steps in a fixed order.

Token ids go in as they are, so no chat template or tokenizer plays a part:

- ``DPOTrainer`` 1.16 cannot be given ids through ``train_dataset`` (``_prepare_dataset``
  always runs ``extract_prompt``, which reads ``chosen``: ``KeyError``). The trainer is
  built on a one-pair text placeholder and ``train_dataset`` is then swapped for the
  ``prompt_ids``/``chosen_ids``/``rejected_ids`` rows that ``_prepare_dataset`` itself
  produces; its ``DataCollatorForPreference`` concatenates them as given (no BOS, no EOS).
- ``CPOTrainer``/``ORPOTrainer`` tokenize text in ``tokenize_row``, which prepends BOS and
  appends EOS when missing; the rows here are built in ``tokenize_row``'s output layout
  (``chosen_input_ids`` = prompt + answer, ``chosen_labels`` = -100 on the prompt), so
  nothing is added either.

The tokenizer the trainers require is a stand-in word-level one over the model's vocabulary
(``t0`` .. ``tN``): with ids given, it only names the pad id, which right padding under an
attention mask leaves out of every number.

TRL logs batch means, not per-pair values; the per-pair rewards and log-probs are the
trainer's own tensors, recorded as its code passes them along: the arguments of
``accelerator.gather`` in ``DPOTrainer._compute_loss`` (checked against the means it logs),
and the results of ``concatenated_forward`` and ``cpo_loss``/``odds_ratio_loss``.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

OBJECTIVES = ("sigmoid", "ipo", "sigmoid_sft", "simpo", "orpo")
DTYPE = torch.float32
"""The dtype the models are loaded in (float64 for comparisons below float32's rounding:
the call reads it at each call, so a test may set it)."""
_DPO_FAMILY = ("sigmoid", "ipo", "sigmoid_sft")


def trl_step(
    hf_dir: str,
    pairs: list[dict],
    objective: str,
    beta: float,
    *,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    sft_weight: float = 0.0,
    lora: dict | None = None,
    lora_state: dict[str, torch.Tensor] | None = None,
    ref_logps: tuple[list[float], list[float]] | None = None,
) -> dict:
    """One batch of ``pairs`` through TRL's loss, then ``backward``.

    Args:
        hf_dir: A folder ``transformers`` loads (``AutoModelForCausalLM``), read in float32.
        pairs: ``{"prompt_ids", "chosen_ids", "rejected_ids"}`` lists of token ids; answers
            exclude the prompt. All pairs form one batch.
        objective: One of :data:`OBJECTIVES`. ``"sigmoid"`` with ``label_smoothing`` > 0 is
            conservative DPO (see :func:`_dpo_terms`).
        beta: TRL's ``beta`` (ORPO's lambda for ``"orpo"``).
        label_smoothing: Conservative DPO's epsilon, in [0, 0.5); CPO's for ``"simpo"``.
        simpo_gamma: SimPO's margin gamma (``CPOConfig.simpo_gamma``).
        sft_weight: Weight of TRL's ``"sft"`` term beside a DPO-family loss.
        lora: ``{"r", "alpha", "dropout", "target_modules"}`` for a peft ``LoraConfig``, or
            None for full fine-tuning.
        lora_state: Adapter weights under peft state-dict names (as
            ``peft.get_peft_model_state_dict`` gives them), loaded before the step.
        ref_logps: Reference log-probs (chosen, rejected) per pair, fed through TRL's
            ``precompute_ref_log_probs`` path; None lets TRL compute them (the base with
            adapters disabled under LoRA, a second copy of ``hf_dir`` otherwise).

    Returns:
        ``loss`` (float); ``chosen_rewards``, ``rejected_rewards``, ``chosen_logps``,
        ``rejected_logps`` (per pair, as TRL defines them for ``objective``); ``grads``:
        every trainable parameter's gradient under HF names, or peft state-dict names under
        LoRA (the keys of ``lora_state``).
    """
    options = _Options(label_smoothing, simpo_gamma, sft_weight)
    with _trainer(hf_dir, pairs, objective, beta, lora, lora_state, ref_logps, options) as trainer:
        model = trainer.model.train()  # as `training_step` leaves it; dropout is off
        batch = trainer.data_collator(list(trainer.train_dataset))
        capture = _CAPTURES[type(trainer).__name__]
        with capture.recording(trainer) as calls:
            loss = trainer.compute_loss(model, batch)
        loss.backward()
        out = capture.per_pair(trainer, calls)
        grads = {
            _peft_name(n): p.grad.clone() for n, p in model.named_parameters() if p.requires_grad
        }
        return {"loss": loss.item(), **out, "grads": grads}


def trl_train(
    hf_dir: str,
    pairs: list[dict],
    objective: str,
    beta: float,
    steps: int,
    lr: float,
    lora: dict | None = None,
    lora_state: dict[str, torch.Tensor] | None = None,
    batch_size: int = 2,
    **options: float,
) -> list[float]:
    """Each step's loss over ``steps`` optimizer steps of the trainer's own ``train()``.

    Batches are ``pairs`` in order (``train_sampling_strategy="sequential"``), cycled when
    ``steps`` outruns them. The optimizer is the trainer's default AdamW (transformers 5 on
    torch >= 2.8: ``adamw_torch_fused``, betas (0.9, 0.999), eps 1e-8, weight decay 0) at a
    constant ``lr``, no warmup, no gradient clipping (``max_grad_norm=0``), one micro-batch
    per step. Other arguments, and ``options`` (``label_smoothing``, ``simpo_gamma``,
    ``sft_weight``), are as in :func:`trl_step`.
    """
    train = {"max_steps": steps, "learning_rate": lr, "per_device_train_batch_size": batch_size}
    with _trainer(
        hf_dir, pairs, objective, beta, lora, lora_state, None, _Options(**options), train
    ) as trainer:
        with _recording(trainer, "compute_loss") as calls:
            trainer.train()
        return [result.item() for _, result in calls]


@dataclass(frozen=True)
class _Options:
    """The loss options besides ``beta`` (see :func:`trl_step`)."""

    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    sft_weight: float = 0.0


def _dpo_terms(objective: str, options: _Options) -> tuple[list[str], list[float]]:
    """``DPOConfig``'s ``loss_type`` and ``loss_weights`` for a DPO-family objective.

    TRL 1.16's ``"sigmoid"`` ignores ``label_smoothing``, and no single loss type is
    conservative DPO, -(1-e) logsig(b h) - e logsig(-b h), for a batch of several pairs
    (``"aot"``/``"aot_unpaired"`` sort the batch and equal it only for one pair). It is,
    exactly, 2(1-e) x ``"sigmoid"`` - (1-2e) x ``"robust"`` (robust = [-(1-e) logsig(b h)
    + e logsig(-b h)] / (1-2e)), which TRL computes when given those two types and weights.
    """
    e = options.label_smoothing
    if not 0.0 <= e < 0.5:
        raise ValueError(f"label_smoothing={e} is outside [0, 0.5); pass e.g. 0.1")
    if objective == "ipo" and e > 0.0:
        raise ValueError(f"ipo takes no label_smoothing (got {e}); pass label_smoothing=0.0")
    if objective == "ipo":
        types, weights = ["ipo"], [1.0]
    elif e > 0.0:
        types, weights = ["sigmoid", "robust"], [2.0 * (1.0 - e), -(1.0 - 2.0 * e)]
    else:
        types, weights = ["sigmoid"], [1.0]
    if objective == "sigmoid_sft" or options.sft_weight:
        types, weights = [*types, "sft"], [*weights, options.sft_weight]
    return types, weights


_COMMON_ARGS = {
    "bf16": False, "gradient_checkpointing": False, "use_cpu": True, "report_to": [],
    "disable_tqdm": True, "save_strategy": "no", "logging_strategy": "no", "seed": 0,
    "train_sampling_strategy": "sequential", "lr_scheduler_type": "constant",
    "warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": 0.0,
    "per_device_train_batch_size": 1, "dataloader_num_workers": 0,
}  # fmt: skip


@contextlib.contextmanager
def _trainer(
    hf_dir: str,
    pairs: list[dict],
    objective: str,
    beta: float,
    lora: dict | None,
    lora_state: dict[str, torch.Tensor] | None,
    ref_logps: tuple[list[float], list[float]] | None,
    options: _Options,
    train: dict | None = None,
) -> Iterator[Any]:
    """A TRL trainer for ``objective`` whose ``train_dataset`` is ``pairs``, as rows its
    own collator takes."""
    import transformers
    from datasets import Dataset

    _check(pairs, objective, ref_logps)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=DTYPE)
    tokenizer = _id_tokenizer(model.config)
    with tempfile.TemporaryDirectory() as out:
        args = {**_COMMON_ARGS, "output_dir": out, "beta": beta, **(train or {})}
        kwargs = {"args": args, "processing_class": tokenizer, "peft_config": _lora_config(lora)}
        placeholder = Dataset.from_list([{"prompt": "t1 t2", "chosen": " t3", "rejected": " t4"}])
        if objective in _DPO_FAMILY:
            trainer = _dpo_trainer(
                model, hf_dir, placeholder, objective, options, ref_logps, kwargs
            )
            rows = _dpo_rows(pairs, ref_logps)
        else:
            trainer = _cpo_or_orpo_trainer(model, placeholder, objective, options, kwargs)
            rows = _cpo_rows(pairs)
        trainer.train_dataset = Dataset.from_list(rows)
        if lora_state is not None:
            _load_lora(trainer.model, lora_state)
        yield trainer


def _dpo_trainer(model, hf_dir, placeholder, objective, options, ref_logps, kwargs) -> Any:
    """``DPOTrainer``; the reference is the base with adapters disabled under LoRA, the
    given ``ref_logps`` (precomputed path), else a second copy loaded from ``hf_dir``."""
    import transformers
    from trl import DPOConfig, DPOTrainer

    loss_type, loss_weights = _dpo_terms(objective, options)
    args = DPOConfig(
        **kwargs.pop("args"), loss_type=loss_type, loss_weights=loss_weights, max_length=None,
        label_smoothing=options.label_smoothing, precompute_ref_log_probs=ref_logps is not None,
    )  # fmt: skip
    ref_model = None
    if kwargs["peft_config"] is None and ref_logps is None:
        ref_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=DTYPE)
    return DPOTrainer(model, ref_model, args=args, train_dataset=placeholder, **kwargs)


def _cpo_or_orpo_trainer(model, placeholder, objective, options, kwargs) -> Any:
    """``CPOTrainer`` with ``loss_type="simpo"`` and ``cpo_alpha=0`` (no NLL term), or
    ``ORPOTrainer``."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    args = kwargs.pop("args")
    if objective == "simpo":
        config = CPOConfig(
            **args, loss_type="simpo", cpo_alpha=0.0, simpo_gamma=options.simpo_gamma,
            label_smoothing=options.label_smoothing,
        )  # fmt: skip
        return CPOTrainer(model, args=config, train_dataset=placeholder, **kwargs)
    return ORPOTrainer(model, args=ORPOConfig(**args), train_dataset=placeholder, **kwargs)


def _dpo_rows(pairs: list[dict], ref_logps) -> list[dict]:
    """``_prepare_dataset``'s output rows, with the precomputed reference log-probs."""
    rows = [{k: list(p[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for p in pairs]
    if ref_logps is not None:
        for row, chosen, rejected in zip(rows, *ref_logps, strict=True):
            row["ref_chosen_logps"], row["ref_rejected_logps"] = float(chosen), float(rejected)
    return rows


def _cpo_rows(pairs: list[dict]) -> list[dict]:
    """``tokenize_row``'s output rows (CPO and ORPO share it), without its BOS/EOS."""
    rows = []
    for pair in pairs:
        prompt = list(pair["prompt_ids"])
        row = {"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
        for side in ("chosen", "rejected"):
            answer = list(pair[f"{side}_ids"])
            row[f"{side}_input_ids"] = prompt + answer
            row[f"{side}_attention_mask"] = [1] * (len(prompt) + len(answer))
            row[f"{side}_labels"] = [-100] * len(prompt) + answer
        rows.append(row)
    return rows


def _check(pairs: list[dict], objective: str, ref_logps) -> None:
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r} is unknown; pass one of {OBJECTIVES}")
    if ref_logps is not None and objective not in _DPO_FAMILY:
        raise ValueError(f"ref_logps is for {_DPO_FAMILY}, not {objective!r}; pass None")
    for i, pair in enumerate(pairs):
        # Without a prompt token nothing predicts an answer's first token, yet TRL's IPO
        # still counts it in the answer length.
        if not all(pair.get(k) for k in ("prompt_ids", "chosen_ids", "rejected_ids")):
            raise ValueError(f"pairs[{i}] has an empty field; give prompt_ids, chosen_ids and "
                             "rejected_ids at least one token each")  # fmt: skip


def _id_tokenizer(config: Any) -> Any:
    """A word-level tokenizer ``t0`` .. ``t{V-1}`` over the model's ids: the trainers need
    one, and with ids given it only names pad/BOS/EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else 0
    bos = config.bos_token_id if isinstance(config.bos_token_id, int) else eos
    return PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token=f"t{eos}", eos_token=f"t{eos}", bos_token=f"t{bos}"
    )


def _lora_config(lora: dict | None) -> Any:
    if lora is None:
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora.get("dropout", 0.0),
        target_modules=list(lora["target_modules"]), bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip


def _load_lora(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Sets every adapter weight from ``state`` (peft state-dict names); a name that is no
    adapter weight, or an adapter weight left out, is an error."""
    trainable = {_peft_name(n) for n, p in model.named_parameters() if p.requires_grad}
    if set(state) != trainable:
        missing, extra = sorted(trainable - set(state)), sorted(set(state) - trainable)
        raise ValueError(f"lora_state misses {missing[:3]} and has extra {extra[:3]}; "
                         "give peft.get_peft_model_state_dict's names")  # fmt: skip
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, {k: v.to(DTYPE) for k, v in state.items()})


def _peft_name(name: str) -> str:
    """A parameter's name as peft's state dict writes it (the adapter name dropped)."""
    return name.replace(".default.", ".")


@contextlib.contextmanager
def _recording(owner: Any, attribute: str) -> Iterator[list[tuple[tuple, Any]]]:
    """Records ``(args, result)`` of each call of ``owner.attribute`` while open."""
    calls: list[tuple[tuple, Any]] = []
    original = getattr(owner, attribute)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        calls.append((args, result))
        return result

    setattr(owner, attribute, recorded)
    try:
        yield calls
    finally:
        delattr(owner, attribute)  # the class's method shows through again


class _DPOCapture:
    """``DPOTrainer._compute_loss`` gathers, in order: chosen and rejected rewards
    (beta * (logp - ref_logp), sums over answer tokens), reward accuracies, margins, chosen
    and rejected log-probs."""

    @staticmethod
    def recording(trainer: Any) -> contextlib.AbstractContextManager:
        return _recording(trainer.accelerator, "gather")

    @staticmethod
    def per_pair(trainer: Any, calls: list) -> dict[str, torch.Tensor]:
        # The metrics' scalar counts pass through `gather` too (`gather_for_metrics`).
        per_pair = [args[0] for args, _ in calls if args[0].dim() == 1]
        if len(per_pair) != 6:
            raise RuntimeError(f"DPOTrainer gathered {len(per_pair)} vectors, not 6: TRL changed")
        names = ("chosen_rewards", "rejected_rewards", None, None, "chosen_logps", "rejected_logps")
        out = {n: x.detach().clone() for n, x in zip(names, per_pair, strict=True) if n}
        logged = trainer._metrics["train"]
        for name, key in (
            ("chosen_rewards", "rewards/chosen"),
            ("rejected_logps", "logps/rejected"),
        ):
            if not math.isclose(
                out[name].mean().item(), logged[key][-1], rel_tol=1e-6, abs_tol=1e-6
            ):
                raise RuntimeError(f"the recorded {name} do not average to TRL's {key}")
        return out


class _PairwiseCapture:
    """CPO and ORPO: ``concatenated_forward`` returns the per-pair log-probs (per-token
    averages for SimPO and ORPO), the loss method (``loss_method``) the per-pair rewards
    (beta * those log-probs)."""

    def __init__(self, loss_method: str) -> None:
        self.loss_method = loss_method

    @contextlib.contextmanager
    def recording(self, trainer: Any) -> Iterator[dict[str, list]]:
        with _recording(trainer, "concatenated_forward") as forward, _recording(
            trainer, self.loss_method
        ) as loss:  # fmt: skip
            yield {"forward": forward, "loss": loss}

    @staticmethod
    def per_pair(trainer: Any, calls: dict[str, list]) -> dict[str, torch.Tensor]:
        (_, forward), (_, loss) = calls["forward"][0], calls["loss"][0]
        return {
            "chosen_rewards": loss[1].clone(), "rejected_rewards": loss[2].clone(),
            "chosen_logps": forward[0].detach().clone(),
            "rejected_logps": forward[1].detach().clone(),
        }  # fmt: skip


_CAPTURES: dict[str, Any] = {
    "DPOTrainer": _DPOCapture(),
    "CPOTrainer": _PairwiseCapture("cpo_loss"),
    "ORPOTrainer": _PairwiseCapture("odds_ratio_loss"),
}
