"""The cheap limits a public request must pass before the router spends anything on it.

They run on the event loop before admission, so each is O(1) or O(size of a small field): no tokenizing,
no copy of the prompt. A request over one is refused INVALID_ARGUMENT with a message naming the field
(the gRPC field names; the HTTP front renames them). The gRPC server's receive limit
(`RouterConfig.max_request_bytes`) bounds the whole message before any of this runs.
"""

from __future__ import annotations

from kvferry.engine.request import InvalidRequestError
from kvferry.v1 import generate_pb2

MAX_REQUEST_ID_CHARS = 256
# and bytes: the cluster's id adds a key's tag and a sibling's suffix, and the pool's data plane carries
# at most 1024 (kvpool.dataplane.MAX_REQUEST_ID)
MAX_REQUEST_ID_BYTES = 960
MAX_STOP_STRINGS = 16  # as vLLM's OpenAI server documents for `stop`
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 128
MAX_CACHE_SALT_CHARS = 256
MAX_LOGIT_BIAS = 300  # entries, as OpenAI documents for `logit_bias`
MAX_ALLOWED_TOKEN_IDS = 2**18  # more than any vocabulary kvferry serves
# A token's text is far shorter than this in every tokenizer kvferry serves (byte-level BPE tokens are
# rarely over 16 characters), so a text longer than max_model_len * this can never fit the model.
PROMPT_CHARS_PER_TOKEN = 64


def max_prompt_chars(max_model_len: int) -> int:
    return max_model_len * PROMPT_CHARS_PER_TOKEN


def check_limits(request: generate_pb2.GenerateRequest, max_model_len: int) -> None:
    """Raise InvalidRequestError when a field of `request` is over its limit."""
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(
            f"request_id: at most {MAX_REQUEST_ID_CHARS} characters, got {len(request.request_id)}"
        )
    if len(request.request_id.encode()) > MAX_REQUEST_ID_BYTES:
        raise InvalidRequestError(f"request_id: at most {MAX_REQUEST_ID_BYTES} bytes of UTF-8")
    which = request.WhichOneof("prompt")
    if which == "text" and len(request.text) > max_prompt_chars(max_model_len):
        raise InvalidRequestError(
            f"prompt.text: at most {max_prompt_chars(max_model_len)} characters "
            f"({PROMPT_CHARS_PER_TOKEN} per token of max_model_len {max_model_len}), got {len(request.text)}"
        )
    if which == "token_ids" and len(request.token_ids.ids) >= max_model_len:
        raise InvalidRequestError(
            f"prompt.token_ids: at most {max_model_len - 1} tokens (max_model_len is {max_model_len}, "
            f"leaving room to generate), got {len(request.token_ids.ids)}"
        )
    if len(request.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(
            f"cache_salt: at most {MAX_CACHE_SALT_CHARS} characters, got {len(request.cache_salt)}"
        )
    sampling = request.sampling
    if len(sampling.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(
            f"sampling.logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(sampling.logit_bias)}"
        )
    if len(sampling.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
        raise InvalidRequestError(
            f"sampling.allowed_token_ids: at most {MAX_ALLOWED_TOKEN_IDS} ids, "
            f"got {len(sampling.allowed_token_ids)}"
        )
    if len(sampling.stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(
            f"sampling.stop: at most {MAX_STOP_STRINGS} stop strings, got {len(sampling.stop)}"
        )
    for i, stop in enumerate(sampling.stop):
        if len(stop) > MAX_STOP_CHARS:
            raise InvalidRequestError(
                f"sampling.stop[{i}]: at most {MAX_STOP_CHARS} characters, got {len(stop)}"
            )
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(
            f"sampling.stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(sampling.stop_token_ids)}"
        )
