"""Packed rows compute what their examples compute one at a time, and masked targets."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import re

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from plugintrain.cli import main as cli_main
from plugintrain.data.datamodules.chat_datamodule import IGNORE_INDEX, PackedChat, pack_rows
from plugintrain.model_zoo import CausalLM, Transformer, TransformerConfig
from plugintrain.model_zoo.cross_entropy import IGNORE_INDEX as LOSS_IGNORE_INDEX
from plugintrain.model_zoo.cross_entropy import chunked_cross_entropy, token_cross_entropy
from plugintrain.model_zoo.layers import document_mask
from plugintrain.precision_plugins import FP32Precision

LENGTHS = (5, 7, 4)  # three examples packed into one row of 16 (4 positions of padding)
SEQ = 16


def prepare_main(argv: list[str]) -> int:
    return cli_main(["prepare", *argv])


def _model(preset: str) -> Transformer:
    torch.manual_seed(0)
    config = dataclasses.replace(TransformerConfig.from_name(preset), n_layer=2, block_size=SEQ)
    return Transformer(config).double()


def _examples(vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(vocab, (n,), generator=generator) for n in LENGTHS]


def _packed(examples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One row holding ``examples`` back to back, then a padding document."""
    tokens = torch.cat([*examples, torch.zeros(SEQ - sum(LENGTHS), dtype=torch.long)])
    positions = torch.cat([torch.arange(n) for n in [*LENGTHS, SEQ - sum(LENGTHS)]])
    return tokens[None], positions[None]


@pytest.mark.parametrize("preset", ["llama3-debug", "gpt2-debug", "deepseek-v3-debug"])
def test_a_packed_row_gives_each_examples_own_logits_and_gradients(preset: str) -> None:
    model = _model(preset)
    examples = _examples(model.config.vocab_size)
    # One at a time: each example alone, its summed next-token loss.
    alone = [model(e[None])[0] for e in examples]
    loss_alone = sum(
        F.cross_entropy(lg[:-1], e[1:], reduction="sum")
        for lg, e in zip(alone, examples, strict=True)
    )
    grads_alone = torch.autograd.grad(loss_alone, list(model.parameters()), allow_unused=True)
    # Packed: one row, positions restarting at each example.
    tokens, positions = _packed(examples)
    logits = model(tokens, positions=positions)[0]
    starts = np.cumsum([0, *LENGTHS])
    for lg, start, end in zip(alone, starts[:-1], starts[1:], strict=True):
        torch.testing.assert_close(logits[start:end], lg, rtol=1e-7, atol=1e-7)
    loss_packed = sum(
        F.cross_entropy(logits[s : e - 1], tokens[0, s + 1 : e], reduction="sum")
        for s, e in itertools.pairwise(starts)
    )
    grads_packed = torch.autograd.grad(loss_packed, list(model.parameters()), allow_unused=True)
    for (name, _), ga, gp in zip(model.named_parameters(), grads_alone, grads_packed, strict=True):
        if ga is None:
            assert gp is None or not gp.any(), name
            continue
        # float64 weights; the MoE router rounds its scores in fp32, batch-dependently
        torch.testing.assert_close(gp, ga, rtol=1e-6, atol=1e-7, msg=name)


def test_no_token_attends_across_an_example_boundary() -> None:
    model = _model("llama3-debug")
    examples = _examples(model.config.vocab_size)
    tokens, positions = _packed(examples)
    before = model(tokens, positions=positions)
    changed = tokens.clone()
    changed[0, : LENGTHS[0]] = (changed[0, : LENGTHS[0]] + 1) % model.config.vocab_size
    after = model(changed, positions=positions)
    first = LENGTHS[0]
    torch.testing.assert_close(after[:, first:], before[:, first:], rtol=0, atol=0)
    assert not torch.allclose(after[:, :first], before[:, :first])  # the edit is visible


def test_document_mask_is_block_diagonal_and_causal() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = document_mask(positions)[0, 0].int()
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ]
    )
    assert torch.equal(mask, expected)


def test_ignore_index_is_the_one_the_loss_skips() -> None:
    assert IGNORE_INDEX == LOSS_IGNORE_INDEX == -100


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_cross_entropy_equals_torch_summed_over_positions(chunk, dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 9, 11, generator=generator).to(dtype).requires_grad_()
    targets = torch.randint(11, (2, 9), generator=generator)
    targets[0, :4] = IGNORE_INDEX
    targets[1, 7:] = IGNORE_INDEX
    ours = chunked_cross_entropy(logits, targets, chunk)
    (ours_grad,) = torch.autograd.grad(ours, logits)
    reference_logits = logits.detach().float().requires_grad_()
    reference = (
        F.cross_entropy(reference_logits.flatten(0, 1), targets.flatten(), reduction="sum")
        / targets.numel()
    )
    (reference_grad,) = torch.autograd.grad(reference, reference_logits)
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours_grad.float(), reference_grad, rtol=tolerance, atol=tolerance)
    assert not ours_grad[0, :4].any() and not ours_grad[1, 7:].any()


def test_unmasked_loss_is_the_plain_mean() -> None:
    logits = torch.randn(3, 5, 7)
    targets = torch.randint(7, (3, 5))
    torch.testing.assert_close(
        token_cross_entropy(logits, targets),
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()),
    )


class _Examples:
    """A ``ChatExamples`` stand-in: given ids and masks."""

    def __init__(self, examples: list[tuple[list[int], list[int]]]) -> None:
        self.items = [(np.array(i, np.int64), np.array(m, dtype=bool)) for i, m in examples]
        self.lengths = np.array([len(i) for i, _ in examples])

    def __len__(self) -> int:
        return len(self.items)

    def example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.items[index]


def test_packed_rows_hold_whole_examples_with_their_targets() -> None:
    examples = _Examples(
        [([1, 2, 3], [0, 1, 1]), ([4, 5], [0, 1]), ([6, 7, 8, 9], [0, 0, 1, 1]), ([10], [1])]
    )
    rows = PackedChat(examples, seq_len=6, pack=True, pad_id=0)
    assert len(rows) == 2  # [ex0, ex1 | pad] and [ex2, ex3 | pad]
    x, y, positions = rows[0]
    assert x.tolist() == [1, 2, 3, 4, 5, 0]
    assert y.tolist() == [2, 3, -100, 5, -100, -100]
    assert positions.tolist() == [0, 1, 2, 0, 1, 0]
    x, y, positions = rows[1]
    assert x.tolist() == [6, 7, 8, 9, 10, 0]
    assert y.tolist() == [-100, 8, 9, -100, -100, -100]
    assert positions.tolist() == [0, 1, 2, 3, 0, 0]
    padded = PackedChat(examples, seq_len=6, pack=False, pad_id=0)
    assert len(padded) == 4
    assert padded[1][0].tolist() == [4, 5, 0, 0, 0, 0]
    assert padded[1][2].tolist() == [0, 1, 0, 1, 2, 3]


def test_pack_rows_follows_the_order_and_never_splits_an_example() -> None:
    lengths = np.array([3, 3, 2, 4, 1])
    starts = pack_rows(lengths, np.array([4, 3, 2, 1, 0]), seq_len=6, pack=True)
    assert starts.tolist() == [0, 2, 4, 5]  # rows [1, 4], [2, 3], [3]: 1+4+2 and 2+3+3 > 6


class _MaskedData(L.LightningDataModule):
    loss_mask = True

    def __init__(self, rows: TensorDataset, batch_size: int) -> None:
        super().__init__()
        self.rows, self.batch_size = rows, batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.rows, batch_size=self.batch_size)


def _masked_rows(vocab: int, rows: int = 4, seq: int = 8) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    x = torch.randint(vocab, (rows, seq), generator=generator)
    y = torch.randint(vocab, (rows, seq), generator=generator)
    for row in range(rows):  # very uneven: 1, 3, 5, 7 scored targets
        y[row, 1 + 2 * row :] = IGNORE_INDEX
    positions = torch.arange(seq).repeat(rows, 1)
    return TensorDataset(x, y, positions)


def test_gradient_accumulation_averages_over_the_steps_targets_not_micro_batches() -> None:
    """Two micro-batches of very different target counts, one SGD step: the weights move as
    plain PyTorch's mean over all scored targets of the step says (not a mean of means)."""
    config = dataclasses.replace(
        TransformerConfig.from_name("llama3-debug"), n_layer=1, block_size=8
    )
    rows = _masked_rows(config.vocab_size)
    L.seed_everything(0, verbose=False)
    sgd = functools.partial(torch.optim.SGD, lr=1.0)
    module = CausalLM(config, sgd, weight_decay=0.0, warmup_steps=0, min_lr_ratio=1.0)
    module.configure_model()
    start = {n: p.detach().clone() for n, p in module.model.state_dict().items()}
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=1, accumulate_grad_batches=2,
        plugins=[FP32Precision()], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=_MaskedData(rows, batch_size=2))

    def reference(mean_of_means: bool) -> dict[str, torch.Tensor]:
        model = Transformer(config)
        model.load_state_dict(start)
        x, y, _ = rows.tensors
        losses = [
            F.cross_entropy(model(x[i : i + 2]).flatten(0, 1), y[i : i + 2].flatten())
            if mean_of_means
            else F.cross_entropy(
                model(x[i : i + 2]).flatten(0, 1), y[i : i + 2].flatten(), reduction="sum"
            )
            for i in (0, 2)
        ]
        loss = sum(losses) / 2 if mean_of_means else sum(losses) / (y != IGNORE_INDEX).sum()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= p.grad
        return {f"model.{n}": p for n, p in model.named_parameters()}

    expected, mean_of_means = reference(False), reference(True)
    far = 0.0
    for name, param in module.named_parameters():
        torch.testing.assert_close(param, expected[name], rtol=1e-5, atol=1e-6, msg=name)
        far = max(far, (expected[name] - mean_of_means[name]).abs().max().item())
    assert far > 1e-3  # the mean of means would have been told apart


def _chat_folder(root, examples: list[tuple[list[int], list[int]]], seq_len: int = 8):
    """A folder as ``plugintrain prepare chat`` writes it (uint32 ids, uint8 mask)."""
    import json

    root.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        ids = np.array([t for i, _ in examples for t in i], np.uint32)
        mask = np.array([t for _, m in examples for t in m], np.uint8)
        offsets = np.cumsum([0, *(len(i) for i, _ in examples)]).astype(np.int64)
        np.save(root / f"{split}.ids.npy", ids)
        np.save(root / f"{split}.mask.npy", mask)
        np.save(root / f"{split}.offsets.npy", offsets)
    meta = {"kind": "chat", "version": 1, "tokenizer": "gpt2", "vocab_size": 50257,
            "seq_len": seq_len, "pack": True, "eos_id": 50256, "pad_id": 50256}  # fmt: skip
    (root / "meta.json").write_text(json.dumps(meta))
    return root


def test_chat_datamodule_batches_a_prepared_folder(tmp_path) -> None:
    from plugintrain.data import ChatDataModule

    folder = _chat_folder(tmp_path / "chat", [([1, 2, 3], [0, 1, 1]), ([4, 5, 6, 7], [0, 0, 1, 1])])
    data = ChatDataModule(str(folder), batch_size=1, shuffle=False, tokenizer="gpt2")
    data.setup("fit")
    x, y, positions = next(iter(data.val_dataloader()))
    assert x.tolist() == [[1, 2, 3, 4, 5, 6, 7, 50256]]
    assert y.tolist() == [[2, 3, -100, -100, 6, 7, -100, -100]]  # int64: -100, not 2**32 - 100
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]


def test_a_chat_folder_and_a_text_datamodule_refuse_each_other(tmp_path) -> None:
    from plugintrain.data import ChatDataModule, TokenDataModule, write_token_bin

    chat = _chat_folder(tmp_path / "chat", [([1, 2, 3], [0, 1, 1])])
    with pytest.raises(ValueError, match=r"holds chat examples .*ChatDataModule"):
        TokenDataModule(str(chat), seq_len=4, batch_size=1)
    text = tmp_path / "text"
    text.mkdir()
    write_token_bin(text / "train.bin", list(range(64)))
    write_token_bin(text / "val.bin", list(range(64)))
    with pytest.raises(ValueError, match=r"not chat examples; prepare them with `plugintrain") as e:
        ChatDataModule(str(text))
    # The hint's folder is beside the text folder, which `prepare chat` leaves alone.
    hint = re.search(r"--out (\S+)` and pass `--data.init_args.data_dir (\S+)`", str(e.value))
    assert hint and hint[1] == hint[2] == str(tmp_path / "text_chat")
    rows = tmp_path / "rows.jsonl"
    pairs = [{"prompt": f"{n} + 1?", "response": str(n + 1)} for n in range(3)]
    rows.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    args = ["chat", str(rows), "--tokenizer", "gpt2", "--template", "plain", "--val_examples", "1"]
    assert prepare_main([*args, "--out", hint[1]]) == 0
    ChatDataModule(hint[2], tokenizer="gpt2")
    with pytest.raises(ValueError, match=r"example of 3 tokens, longer than seq_len=2"):
        ChatDataModule(str(chat), seq_len=2).setup("fit")
    with pytest.raises(ValueError, match=r"holds gpt2 tokens .* `--tokenizer llama3`"):
        ChatDataModule(str(chat), tokenizer="llama3")
