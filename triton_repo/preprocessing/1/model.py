"""Triton binding of preprocessing: text_input -> input_ids (chat template), input_lengths, end_id.

Parameters: target, tokenizer_factory (``DSPARK_TARGET`` / ``DSPARK_TOKENIZER_FACTORY``
override), apply_chat_template, system_prompt. Logic: dspark.engine.serving.text.
"""
import triton_python_backend_utils as pb_utils

from dspark.engine.serving.factory import as_bool, parameter, text_model_setup
from dspark.engine.serving.stubs import watch_server
from dspark.engine.serving.tensors import answer_requests
from dspark.engine.serving.text import Preprocessor


class TritonPythonModel:
    def initialize(self, args):
        watch_server()  # end this stub with its server, even after a kill -9 of the server
        params, self.input_names, tokenizer = text_model_setup(args)
        self.pre = Preprocessor(
            tokenizer,
            apply_chat_template=as_bool(parameter(params, "apply_chat_template", "true", env=False)),
            system_prompt=parameter(params, "system_prompt", "", env=False))

    def execute(self, requests):
        return answer_requests(pb_utils, requests, self.input_names, self.pre)
