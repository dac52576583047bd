"""TGI's wire format: the /generate request, its error body, and the token objects of responses.

Field names and defaults follow TGI's router (`parameters.max_new_tokens` defaults to 100,
`details` to false). Unknown fields are rejected: a TGI field we do not implement must not be
silently dropped, so each one is listed here and refused with a message in `serving.py`.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# TGI's defaults for its launcher's --max-stop-sequences and --max-best-of; /info reports them.
MAX_STOP_SEQUENCES = 4
MAX_BEST_OF = 1


class TGIError(Exception):
    """An error rendered as TGI renders them: {"error": message, "error_type": kind}."""

    def __init__(self, message: str, status_code: int = 422, error_type: str = "validation",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.error_type = error_type
        self.headers = headers

    def body(self) -> dict:
        return {"error": self.message, "error_type": self.error_type}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class GenerateParameters(_Strict):
    adapter_id: str | None = None
    best_of: int | None = None
    decoder_input_details: bool = False
    details: bool = False
    do_sample: bool = False
    frequency_penalty: float | None = None
    grammar: dict | None = None
    max_new_tokens: int | None = 100
    repetition_penalty: float | None = None
    return_full_text: bool | None = None
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    temperature: float | None = None
    top_k: int | None = None
    top_n_tokens: int | None = None
    top_p: float | None = None
    truncate: int | None = None
    typical_p: float | None = None
    watermark: bool = False


class GenerateRequest(_Strict):
    inputs: str
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    # POST / picks /generate or /generate_stream by this flag, as TGI's compatibility route does
    stream: bool = False


def token_dict(tid: int, text: str, logprob: float | None, special: bool | None = None) -> dict:
    d = {"id": tid, "text": text, "logprob": logprob}
    if special is not None:
        d["special"] = special
    return d
