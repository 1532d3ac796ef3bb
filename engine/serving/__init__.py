"""Serving logic behind triton_repo/, written without Triton so it is testable in-process.

Each ``triton_repo/<model>/1/model.py`` is a thin binding: it converts Triton requests to
dicts of numpy arrays, calls into this package and converts the answers back.

- ``tensors``: tensor names and small numpy helpers shared by the models.
- ``requests``: request parsing and validation -> ``SamplingParams`` (clear errors).
- ``detokenizer``: stateless incremental detokenization (no broken UTF-8 in streams).
- ``text``: the preprocessing and postprocessing steps (text <-> token ids).
- ``llm``: ``LLMService``, one ``GenerationEngine`` behind a stream of Triton requests.
- ``metrics``: the custom Prometheus metrics (drafts, acceptance, batch occupancy).
- ``factory``: ``module:function`` references and model parameters with env overrides.
"""
