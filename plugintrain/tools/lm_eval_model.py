"""plugintrain's models in lm-evaluation-harness: the ``plugintrain`` model type.

``PluginTrainLM`` runs any weights plugintrain loads (a ``fit`` checkpoint or run
directory, a Hugging Face directory, GGUF, llm.c, a pretrained name), with a LoRA run's
or a PEFT adapter, on any device, behind lm-eval's model interface: loglikelihood,
rolling loglikelihood and generate-until. Requests are encoded exactly as lm-eval's own
``hf`` model encodes them (its ``TemplateLM`` splits context and continuation; BOS where
the family's tokenizer adds it, as ``transformers`` does on an export), scored in
float32 and generated greedily, so the two give the same scores on the same weights.

Registered under ``plugintrain`` when this module is imported. lm-eval 0.4.13 finds
model types only among its own modules, so ``plugintrain lm-eval ARGS`` runs lm-eval's
command line with this one registered (``plugintrain lm-eval run --model plugintrain
--model_args weights=...,adapter=... --tasks ...``), and ``plugintrain evaluate --tasks``
calls ``lm_eval.simple_evaluate`` with it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)

from plugintrain.data.tokenizers.registry import get_tokenizer
from plugintrain.tools._models import load_model, model_tokenizer, pick_device


def _flag(value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    return str(value).lower() in ("1", "true", "yes")


@register_model("plugintrain")
class PluginTrainLM(TemplateLM):
    """lm-eval's model interface over a plugintrain model.

    Args:
        weights: What ``plugintrain generate --weights`` takes.
        adapter: A LoRA run's checkpoint or a PEFT adapter directory, merged into the base.
        device: ``cpu``, ``cuda``, ``cuda:1``, ... (default: CUDA when there is one).
        batch_size: Sequences scored in one forward pass.
        max_length: Context length (default: the model's ``block_size``).
        max_gen_toks: Default bound of generated tokens (a task's ``max_gen_toks`` wins).
        add_bos_token: Lead every text with BOS (default: as the tokenizer does).
        tokenizer: Another tokenizer spec (default: the one the weights came with).
        module: Instead of ``weights``: a model already loaded (a training run's, with
            ``config`` and ``model``, on its device), as
            :class:`~plugintrain.callbacks.Evaluate` evaluates it during training.
    """

    backend = "causal"

    def __init__(
        self,
        weights: str | None = None,
        adapter: str | None = None,
        device: str | None = None,
        batch_size: int | str = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | str | None = None,
        tokenizer: str | None = None,
        module: Any = None,
        **_: Any,
    ) -> None:
        super().__init__()
        if module is None and weights is None and adapter is None:
            raise ValueError("pass --model_args weights=WEIGHTS (and adapter=ADAPTER)")
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's command line passes cuda:0 unless told; its hf model falls back too
            print(
                f"plugintrain: no CUDA device for --device {device}; using the CPU", file=sys.stderr
            )
            device = "cpu"
        if module is not None:  # a live model (plugintrain.callbacks.Evaluate), on its device
            self._device, self.module = module.device, module
        else:
            self._device = pick_device(device)
            self.module = load_model(weights, adapter, merge=adapter is not None).to(self._device)
        self.tokenizer = get_tokenizer(tokenizer or model_tokenizer(self.module))
        self.batch_size = int(str(batch_size).split(":")[0]) if str(batch_size) != "auto" else 8
        self.max_length = int(max_length or self.module.config.block_size)
        self.max_gen_toks = int(max_gen_toks)
        add_bos = _flag(add_bos_token)
        self.add_bos = bool(self.tokenizer.add_bos) if add_bos is None else add_bos
        self._specials = set(self.tokenizer.special_tokens.values())

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name

    def tok_encode(
        self,
        string: str,
        add_special_tokens: bool | None = None,
        left_truncate_len: int | None = None,
        **_: Any,
    ) -> list[int]:
        """Ids of ``string`` (BOS first where the tokenizer leads texts with it, unless
        ``add_special_tokens`` is False or the string already starts with BOS's text)."""
        bos = self.add_bos if add_special_tokens is not False else False
        if add_special_tokens is None and has_bos_prefix(
            string, self.tokenizer.decode([self.tokenizer.bos_id])
        ):
            bos = False
        ids = self.tokenizer.encode(string, bos=bos)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self._specials])

    @torch.no_grad()
    def _logprobs(self, rows: list[list[int]]) -> list[torch.Tensor]:
        """Log-softmax (float32) of every position of each row, rows right-padded into
        batches (a causal model's positions never see the padding after them)."""
        out: list[torch.Tensor] = []
        for start in range(0, len(rows), self.batch_size):
            batch = rows[start : start + self.batch_size]
            width = max(len(r) for r in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            for i, row in enumerate(batch):
                ids[i, : len(row)] = torch.tensor(row)
            logits = self.module(ids.to(self._device)).float()
            out.extend(
                F.log_softmax(logits[i, : len(r)], dim=-1).cpu() for i, r in enumerate(batch)
            )
        return out

    def _loglikelihood_tokens(
        self, requests: list, disable_tqdm: bool = False, **_: Any
    ) -> list[tuple[float, bool]]:
        """Sum of the continuation's log-probabilities and whether each was the argmax,
        on the last ``max_length`` tokens of context + continuation (lm-eval's ``hf``)."""
        rows, spans = [], []
        for _key, context, continuation in requests:
            whole = (context + continuation)[-(self.max_length + 1) :]
            rows.append(whole[:-1])
            spans.append(continuation)
        results = []
        for logprobs, target in zip(self._logprobs(rows), spans, strict=True):
            picked = logprobs[-len(target) :]
            wanted = torch.tensor(target)
            score = float(picked.gather(-1, wanted[:, None]).sum())
            greedy = bool((picked.argmax(-1) == wanted).all())
            results.append((score, greedy))
            self.cache_hook.add_partial("loglikelihood", None, (score, greedy))
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts in windows of ``max_length`` (lm-eval's rule)."""
        scores = []
        for request in requests:
            (string,) = request.args
            windows = map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),  # as lm-eval's hf model: BOS kept
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            )
            pieces = self._loglikelihood_tokens([(None, c, t) for c, t in windows])
            scores.append(sum(score for score, _ in pieces))
        return scores

    @torch.no_grad()
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first stop sequence (the task's ``until`` and
        the tokenizer's EOS)."""
        from plugintrain.model_zoo.generation import generate_tokens

        eos = self.tokenizer.decode([self.eot_token_id])
        answers = []
        for request in requests:
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            budget = int(kwargs.pop("max_gen_toks"))
            prompt = self.tok_encode(context, left_truncate_len=self.max_length - budget)
            produced: list[int] = []
            ids = torch.tensor([prompt], device=self._device)
            steps = generate_tokens(
                self.module.model, ids, budget, temperature=0.0, stop_ids=[self.eot_token_id]
            )
            for step in steps:
                produced.append(int(step[0, 0]))
                text = self.tok_decode(produced)
                if produced[-1] == self.eot_token_id or any(s in text for s in until):
                    steps.close()
                    break
            answer = postprocess_generated_text(
                self.tok_decode(produced), stop=until, think_end_token=None
            )
            answers.append(answer)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), answer)
        return answers


def lm_eval_main(argv: Sequence[str]) -> int:
    """``plugintrain lm-eval ARGS``: lm-eval's own command line, with ``plugintrain``
    among its model types."""
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0
