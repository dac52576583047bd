"""TGI's generation routes over the same engine and checks as the OpenAI routes.

A TGI request becomes one engine request: `do_sample` (or any sampling knob, as TGI decides)
selects sampling, else greedy; `stop` sequences end generation and stay in the text, as in TGI;
`details` returns per-token ids, text and logprobs (`top_n_tokens` adds the top candidates,
`decoder_input_details` the prompt's own logprobs); `truncate` keeps the last N prompt tokens.
TGI fields pagedserve does not implement (grammar, adapters, watermark, typical_p, best_of > 1)
are refused with TGI's validation error rather than dropped.
"""
from __future__ import annotations

import json
import random
from typing import AsyncIterator

from fastapi import Request

from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.protocol import SSE_PING, APIError, random_id
from pagedserve.server.serving_base import (
    ClientDisconnected,
    OpenAIServing,
    SSEResponse,
    engine_error_to_api,
    merge_streams,
    run_until_disconnect,
)
from pagedserve.server.tgi.protocol import MAX_BEST_OF, MAX_STOP_SEQUENCES, GenerateRequest, TGIError, token_dict

_MIN_LOGPROB = -9999.0  # JSON has no -inf
# engine field names → the TGI parameter the client set
_TGI_NAMES = {"logprobs": "top_n_tokens", "prompt": "inputs"}


def tgi_error_from_api(e: APIError) -> TGIError:
    """An OpenAI-side error (engine admission, length checks) in TGI's terms."""
    if e.status_code == 400:
        return TGIError(e.message, 422, "validation")
    if e.status_code == 503 and e.code == "server_overloaded":
        return TGIError(e.message, 429, "overloaded", headers=e.headers)
    return TGIError(e.message, e.status_code, "unhealthy" if e.status_code == 503 else "generation", e.headers)


def _unsupported(p) -> str | None:
    checks = (
        ("grammar", p.grammar is not None, "constrained decoding is not supported yet"),
        ("adapter_id", p.adapter_id is not None, "LoRA adapters are not supported yet"),
        ("watermark", p.watermark, "watermarking is not supported"),
        ("typical_p", p.typical_p is not None and p.typical_p != 1.0, "typical sampling is not supported"),
        ("best_of", p.best_of is not None and p.best_of > MAX_BEST_OF, f"best_of must be at most {MAX_BEST_OF}"),
    )
    for name, on, why in checks:
        if on:
            return f"`{name}`: {why} by pagedserve"
    return None


class TGIServing(OpenAIServing):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.special_ids = set(getattr(self.tokenizer, "all_special_ids", None) or [])

    # -- request → engine ---------------------------------------------------------------------
    def prepare(self, req: GenerateRequest, streaming: bool) -> tuple[list[int], SamplingParams, int | None]:
        p = req.parameters
        msg = _unsupported(p)
        if msg:
            raise TGIError(msg)
        if streaming and p.decoder_input_details:
            raise TGIError("`decoder_input_details` == true is not supported when streaming tokens")
        if p.decoder_input_details and not p.details:
            raise TGIError("`decoder_input_details` needs `details`: true (the prefill is part of the details)")
        if not req.inputs:
            raise TGIError("`inputs` cannot be empty")
        positive = (("temperature", p.temperature), ("top_k", p.top_k), ("repetition_penalty", p.repetition_penalty),
                    ("max_new_tokens", p.max_new_tokens), ("truncate", p.truncate))
        for name, v in positive:
            if v is not None and v <= 0:
                raise TGIError(f"`{name}` must be strictly positive")
        if p.seed is not None and not (0 <= p.seed < 2**63):
            raise TGIError("`seed` must be in [0, 2^63)")
        if p.top_p is not None and not (0.0 < p.top_p <= 1.0):
            raise TGIError("`top_p` must be > 0.0 and <= 1.0")
        if len(p.stop) > MAX_STOP_SEQUENCES:
            raise TGIError(f"`stop` supports up to {MAX_STOP_SEQUENCES} stop sequences. Given: {len(p.stop)}")
        try:
            ids = self.encode_prompt(req.inputs, True, param="inputs")
        except InvalidRequestError as e:
            raise TGIError(f"`inputs`: {e}") from None
        if p.truncate is not None and len(ids) > p.truncate:
            ids = ids[-p.truncate:]
        # TGI samples when asked to, or when any sampling knob is set; otherwise it is greedy
        sampling = (p.do_sample or (p.temperature is not None and p.temperature != 1.0) or bool(p.top_k)
                    or (p.top_p is not None and p.top_p < 1.0))
        seed = (p.seed if p.seed is not None else random.getrandbits(63)) if sampling else None
        params = SamplingParams(
            temperature=(p.temperature or 1.0) if sampling else 0.0,
            top_p=p.top_p if (sampling and p.top_p is not None) else 1.0,
            top_k=p.top_k if (sampling and p.top_k) else 0,
            repetition_penalty=1.0 if p.repetition_penalty is None else p.repetition_penalty,
            frequency_penalty=p.frequency_penalty or 0.0,
            seed=seed,
            stop=list(p.stop),
            include_stop_str_in_output=True,  # TGI keeps the stop sequence in generated_text
            max_tokens=p.max_new_tokens,  # None: the rest of the context (the engine's validator fills it)
            logprobs=p.top_n_tokens or 0,  # every TGI token carries its logprob
            prompt_logprobs=0 if p.decoder_input_details else None,
        )
        return ids, params, seed

    async def _submit(self, rid: str, text: str, ids: list[int], params: SamplingParams):
        """Queue the request; the engine validates it, and its error is told in TGI's field names."""
        try:
            return await self.submit([rid], [(text, ids)], [params], max_tokens_param="max_new_tokens")
        except APIError as e:
            if e.param in _TGI_NAMES:
                e.message = e.message.replace(e.param, _TGI_NAMES[e.param])
            raise tgi_error_from_api(e) from None

    # -- response pieces ----------------------------------------------------------------------
    @staticmethod
    def finish_reason(o) -> str:
        if o.finish_reason == "length":
            return "length"
        return "stop_sequence" if isinstance(o.stop_reason, str) else "eos_token"

    def _token(self, tid: int, lpd, text: str | None = None, with_special: bool = True) -> dict:
        chosen = (lpd or {}).get(tid)
        if text is None:
            text = self._tok_str(tid, chosen)
        lp = max(chosen.logprob, _MIN_LOGPROB) if chosen is not None else None
        return token_dict(tid, text, lp, (tid in self.special_ids) if with_special else None)

    def _top(self, lpd, n: int) -> list[dict]:
        ranked = sorted((lpd or {}).items(), key=lambda kv: -kv[1].logprob)[:n]
        return [self._token(t, {t: lp}) for t, lp in ranked]

    def _split_delta(self, new_ids: list[int], delta: str) -> list[str]:
        """Text per new token: the decoded delta goes to the last non-special token (the others
        are bytes of a character still incomplete); special tokens show their own piece, as in TGI."""
        texts = ["" for _ in new_ids]
        normal = [j for j, t in enumerate(new_ids) if t not in self.special_ids]
        for j, t in enumerate(new_ids):
            if t in self.special_ids:
                texts[j] = self.tokenizer.decode([t], skip_special_tokens=False)
        if normal:
            texts[normal[-1]] = delta
        elif texts:
            texts[-1] += delta
        return texts

    # -- POST /generate -------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest, raw: Request) -> dict | None:
        ids, params, seed = self.prepare(req, streaming=False)
        rid = random_id("tgi")
        try:
            return await run_until_disconnect(raw, self._generate(req, rid, ids, params, seed))
        except ClientDisconnected:
            return None

    async def _generate(self, req, rid, ids, params, seed) -> dict:
        streams = await self._submit(rid, req.inputs, ids, params)
        final = None
        try:
            async for _, out in merge_streams(streams, None):
                final = out
        except Exception as e:  # noqa: BLE001
            raise tgi_error_from_api(engine_error_to_api(e)) from None
        finally:
            self.abort_all([rid])
        p = req.parameters
        o = final.outputs[0]
        body: dict = {"generated_text": (req.inputs + o.text) if p.return_full_text else o.text}
        if p.details:
            lps = list(o.logprobs or [None] * len(o.token_ids))
            details = {
                "finish_reason": self.finish_reason(o),
                "generated_tokens": len(o.token_ids),
                "seed": seed,
                "prefill": [],
                "tokens": [self._token(t, lpd) for t, lpd in zip(o.token_ids, lps)],
            }
            if p.decoder_input_details:
                plps = list(final.prompt_logprobs or [None] * len(final.prompt_token_ids))
                details["prefill"] = [self._token(t, lpd, with_special=False)
                                      for t, lpd in zip(final.prompt_token_ids, plps)]
            if p.top_n_tokens:
                details["top_tokens"] = [self._top(lpd, p.top_n_tokens) for lpd in lps]
            body["details"] = details
        return body

    # -- POST /generate_stream ------------------------------------------------------------------
    async def generate_stream(self, req: GenerateRequest) -> SSEResponse:
        ids, params, seed = self.prepare(req, streaming=True)
        rid = random_id("tgi")
        streams = await self._submit(rid, req.inputs, ids, params)
        return SSEResponse(self._events(req, rid, streams, seed, len(ids)), on_close=lambda: self.abort_all([rid]))

    async def _events(self, req, rid, streams, seed, n_prompt) -> AsyncIterator[str]:
        p = req.parameters
        index = prev_tok = prev_text = 0
        try:
            async for item in merge_streams(streams, self.ctx.ping_seconds):
                if item is None:
                    yield SSE_PING
                    continue
                o = item[1].outputs[0]
                new_ids = list(o.token_ids[prev_tok:])
                new_lps = list(o.logprobs[prev_tok:]) if o.logprobs is not None else [None] * len(new_ids)
                texts = self._split_delta(new_ids, o.text[prev_text:])
                prev_tok, prev_text = len(o.token_ids), len(o.text)
                for j, (tid, lpd) in enumerate(zip(new_ids, new_lps)):
                    index += 1
                    last = o.finish_reason is not None and j == len(new_ids) - 1
                    event = {
                        "index": index,
                        "token": self._token(tid, lpd, texts[j]),
                        "top_tokens": self._top(lpd, p.top_n_tokens) if p.top_n_tokens else [],
                        "generated_text": ((req.inputs + o.text) if p.return_full_text else o.text) if last else None,
                        "details": {"finish_reason": self.finish_reason(o), "generated_tokens": len(o.token_ids),
                                    "seed": seed, "input_length": n_prompt} if (last and p.details) else None,
                    }
                    yield "data:" + json.dumps(event) + "\n\n"
        except Exception as e:  # noqa: BLE001 - the stream is open: report in-band as TGI does
            try:
                err = tgi_error_from_api(engine_error_to_api(e))
            except Exception as bug:  # noqa: BLE001
                err = TGIError(f"internal error: {type(bug).__name__}: {bug}", 500, "generation")
            yield "data:" + json.dumps(err.body()) + "\n\n"
        finally:
            self.abort_all([rid])
