"""Triton binding of the DSpark LLM model (decoupled): one GenerationEngine, in-flight batching.

All request logic lives in ``dspark.engine.serving`` (tested without a server); this file
only converts between the python backend's objects and numpy, and loads the engine.

Parameters (config.pbtxt; ``DSPARK_<NAME>`` in the server environment overrides
engine_factory, engine_dir, scheduler, device, proposers, engine_kwargs and num_threads): the engine
is ``<engine_factory>(engine_dir, mode=, scheduler=, device=, **engine_kwargs)``, with
``proposers=`` added when the ``proposers`` parameter is set (else the engine directory's default).
"""
import json

import triton_python_backend_utils as pb_utils

from dspark.engine.serving import llm as service
from dspark.engine.serving.factory import config_parameters, parameter, resolve
from dspark.engine.serving.metrics import ServingMetrics
from dspark.engine.serving.stubs import watch_server

DEFAULT_ENGINE_FACTORY = "dspark.engine.runtime:load_engine"


def _error(message, code):
    # pb_utils' error classes exist only in a serving stub (not while Triton auto-completes
    # the config), so they are looked up here rather than at import time.
    codes = {service.INVALID_ARG: pb_utils.TritonError.INVALID_ARG,
             service.CANCELLED: pb_utils.TritonError.CANCELLED,
             service.UNAVAILABLE: pb_utils.TritonError.UNAVAILABLE}
    return pb_utils.TritonError(message, codes.get(code, pb_utils.TritonError.INTERNAL))


def _metric_family(name, description, kind):
    kinds = {"counter": pb_utils.MetricFamily.COUNTER, "gauge": pb_utils.MetricFamily.GAUGE,
             "histogram": pb_utils.MetricFamily.HISTOGRAM}
    return pb_utils.MetricFamily(name=name, description=description, kind=kinds[kind])


class _Channel:
    """ResponseChannel over one request's decoupled response sender."""

    __slots__ = ("request", "sender")

    def __init__(self, request):
        self.request = request  # kept alive until the final response
        self.sender = request.get_response_sender()

    def send(self, tensors, final, error=None, code=service.INTERNAL):
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        if error is not None:
            self.sender.send(pb_utils.InferenceResponse(error=_error(error, code)), flags=flags)
        elif tensors is None:
            self.sender.send(flags=flags)
        else:
            self.sender.send(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(name, value) for name, value in tensors.items()]), flags=flags)
        if final:
            self.request = None

    def is_cancelled(self):
        return self.request is None or self.request.is_cancelled()


class TritonPythonModel:
    def initialize(self, args):
        watch_server()  # end this stub with its server, even after a kill -9 of the server
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("dspark_llm needs model_transaction_policy { decoupled: true }")
        params = config_parameters(config)
        self.input_names = [i["name"] for i in config["input"]]
        name = args["model_name"]
        threads = int(parameter(params, "num_threads", "0"))
        if threads > 0:
            import torch

            torch.set_num_threads(threads)
        factory_ref = parameter(params, "engine_factory", DEFAULT_ENGINE_FACTORY) or DEFAULT_ENGINE_FACTORY
        engine_dir = parameter(params, "engine_dir") or None
        mode = parameter(params, "mode", "spec", env=False)
        scheduler = parameter(params, "scheduler", "algorithm1")
        device = parameter(params, "device", "cpu")
        extra = json.loads(parameter(params, "engine_kwargs", "{}") or "{}")  # e.g. {"max_batch": 64}
        proposers = parameter(params, "proposers", "")  # "": the engine directory's default (engine.json)
        if proposers:
            extra["proposers"] = proposers
        pb_utils.Logger.log_info(
            f"{name}: loading engine via {factory_ref} (engine_dir={engine_dir}, mode={mode}, "
            f"scheduler={scheduler}, device={device}, extra={extra})")
        engine = resolve(factory_ref)(engine_dir, mode=mode, scheduler=scheduler, device=device, **extra)
        metrics = ServingMetrics(_metric_family, {"model": name, "mode": mode})
        self.service = service.LLMService(
            engine, metrics,
            default_max_tokens=int(parameter(params, "default_max_tokens", "64", env=False)),
            cancel_poll_s=int(parameter(params, "cancel_poll_ms", "100", env=False)) / 1000.0,
            name=name)
        self.service.start()
        pb_utils.Logger.log_info(f"{name}: ready, max_context={engine.max_context}")

    def execute(self, requests):
        for request in requests:
            inputs = {}
            for n in self.input_names:
                tensor = pb_utils.get_input_tensor_by_name(request, n)
                if tensor is not None:
                    inputs[n] = tensor.as_numpy()
            self.service.submit(_Channel(request), inputs, request.parameters(), request.request_id())
        return None

    def finalize(self):
        self.service.close()
