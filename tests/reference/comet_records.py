"""The metrics and parameters of a Comet offline archive (``OFFLINE_DIR/*.zip``), read as
``comet upload`` reads it: each line of ``messages.json`` checked against Comet's own JSON
schemas (``comet_ml.schemas``) and rebuilt with Comet's own message classes
(``comet_ml.messages``); ``experiment.json`` checked against its schema too.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any


def read(archive: Path) -> tuple[dict[str, dict[int, float]], dict[str, Any]]:
    """``(metrics, parameters)`` of an offline archive: metric name -> step -> value (the
    last value logged at a step), parameter name -> value."""
    from comet_ml import messages, schemas

    metric_schema = schemas.get_metric_msg_validator(allow_additional_properties=False)
    parameter_schema = schemas.get_parameter_msg_validator(allow_additional_properties=False)
    with zipfile.ZipFile(archive) as files:
        experiment = json.loads(files.read("experiment.json"))
        schemas.get_experiment_file_validator().validate(experiment)
        lines = files.read("messages.json").decode().splitlines()
    metrics: dict[str, dict[int, float]] = {}
    parameters: dict[str, Any] = {}
    for line in lines:
        message = json.loads(line)
        payload = message["payload"]
        if message["type"] == messages.MetricMessage.type:
            metric_schema.validate(payload)
            metric = messages.MetricMessage.from_message_dict(payload).metric
            if metric["step"] is None:  # Comet's own measurements, logged without a step
                continue
            value = float(metric["metricValue"])
            metrics.setdefault(metric["metricName"], {})[int(metric["step"])] = value
        elif message["type"] == messages.ParameterMessage.type:
            parameter_schema.validate(payload)
            parameter = messages.ParameterMessage.from_message_dict(payload)
            item = parameter.param or parameter.params
            parameters[item["paramName"]] = item["paramValue"]
    return metrics, parameters
