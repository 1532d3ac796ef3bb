"""Triton binding of postprocessing: output_ids (+ prefix_ids) -> text_output; stats pass through.

Stateless, so streamed chunks of many requests can interleave: each chunk carries the
few already-streamed tokens it needs (see dspark.engine.serving.detokenizer).
A chunk of a cancelled ensemble request stops its LLM request (a BLS ``stop`` request
with the chunk's request_key): Triton does not cancel a running ensemble step itself.
Parameters: target, tokenizer_factory, skip_special_tokens.
"""
import numpy as np
import triton_python_backend_utils as pb_utils

from dspark.engine.serving.factory import as_bool, parameter, text_model_setup
from dspark.engine.serving.llm import CancelRelay
from dspark.engine.serving.stubs import watch_server
from dspark.engine.serving.tensors import answer_requests
from dspark.engine.serving.text import Postprocessor


def _send_stop(model_name, key):
    """BLS request {stop: true, request_key} to the LLM model that produced ``key``."""
    request = pb_utils.InferenceRequest(
        model_name=model_name,
        inputs=[pb_utils.Tensor("stop", np.array([[True]], dtype=np.bool_)),
                pb_utils.Tensor("request_key", np.array([[key.encode()]], dtype=np.object_))],
        requested_output_names=[])
    for response in request.exec(decoupled=True):
        if response.has_error():
            pb_utils.Logger.log_warn(f"stopping {key} failed: {response.error().message()}")


class TritonPythonModel:
    def initialize(self, args):
        watch_server()  # end this stub with its server, even after a kill -9 of the server
        params, self.input_names, tokenizer = text_model_setup(args)
        self.post = Postprocessor(
            tokenizer,
            skip_special_tokens=as_bool(parameter(params, "skip_special_tokens", "true", env=False)))
        self.relay = CancelRelay(_send_stop)

    def execute(self, requests):
        return answer_requests(pb_utils, requests, self.input_names, self.post, before=self._relay_cancel)

    def _relay_cancel(self, request, inputs):
        if request.is_cancelled():  # the ensemble request was cancelled: stop the LLM request
            key = inputs.get("request_key")
            self.relay.cancelled(key.reshape(-1)[0].decode() if key is not None else "")
            # answered normally: an error here would leave the ensemble request in flight
