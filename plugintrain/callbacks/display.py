"""What ``plugintrain fit`` shows on the console: Lightning's progress bar and model summary,
less two numbers they print wrong for plugintrain's runs."""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch.callbacks import ModelSummary, RichProgressBar
from typing_extensions import override

from plugintrain.core.lightning_seam import format_summary_table

# Lightning's own summary logs here, and Lightning gives this logger a console handler.
log = logging.getLogger("lightning.pytorch.callbacks.model_summary")


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar, without a last epoch when there is none.

    A run bounded by ``max_steps`` alone has ``max_epochs = -1`` (no limit), which
    ``RichProgressBar`` prints as ``Epoch 0/-2``; such a run shows ``Epoch 0``.
    """

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        # Padded as Lightning pads, so the bar does not jump when validation starts.
        return f"Epoch {current_epoch}".ljust(len(self.validation_description))


class CountedFlopsSummary(ModelSummary):
    """Lightning's model summary, with FLOPs only where they were counted.

    Lightning counts FLOPs by running the module's ``example_input_array`` at fit start.
    plugintrain's models have none (a pipeline rank holds only its stages and could not run
    it), so every count reads 0, which looks like a measurement; the FLOPs column and the
    total are left out then. A language model's training FLOPs per token are
    ``TransformerConfig.flops_per_token``, logged as MFU by the throughput monitor.
    """

    @staticmethod
    @override
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            ModelSummary.summarize(
                summary_data,
                total_parameters,
                trainable_parameters,
                model_size,
                total_training_modes,
                total_flops,
                **summarize_kwargs,
            )
            return
        columns = [column for column in summary_data if column[0] != "FLOPs"]
        table = format_summary_table(
            total_parameters, trainable_parameters, model_size, total_training_modes, 0, *columns
        )
        lines = [line for line in table.splitlines() if not line.endswith("Total Flops")]
        log.info("\n" + "\n".join(lines))
