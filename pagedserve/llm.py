"""The offline Python API: `LLM(model=...).generate(...)` / `.chat(...)`, named as in vLLM."""
from __future__ import annotations

import itertools
from typing import Sequence as Seq

from pagedserve.config import EngineConfig
from pagedserve.engine.engine import LLMEngine
from pagedserve.engine.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        legacy = (kwargs.pop("speculative_model", None), kwargs.pop("num_speculative_tokens", None))
        if legacy != (None, None):  # the older keyword form of speculative_config
            from pagedserve.spec.config import from_legacy_flags

            if kwargs.get("speculative_config") is not None:
                raise ValueError("pass speculative_config or speculative_model/num_speculative_tokens, not both")
            kwargs["speculative_config"] = from_legacy_flags(*legacy)
        self.llm_engine = LLMEngine(kwargs.pop("config", None) or EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        return cls(config=config)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's defaults (`generation_config`, as the server applies them);
        what `generate` and `chat` use when given none."""
        from pagedserve.generation_defaults import generation_defaults

        cfg = self.llm_engine.config
        defaults, _ = generation_defaults(cfg.generation_config, cfg.model)
        return SamplingParams(**defaults)

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """prompts: a string, a list of strings, {"prompt_token_ids": [...]} / {"prompt": ...} dicts, or a mix."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError("sampling_params must be one object or one per prompt")
        ids = []
        eng = self.llm_engine
        try:
            for p, sp in zip(prompts, params):
                rid = str(next(self._ids))
                sp = _copy(sp)
                if isinstance(p, dict):
                    eng.add_request(rid, p.get("prompt"), sp, prompt_token_ids=p.get("prompt_token_ids"))
                else:
                    eng.add_request(rid, p, sp)
                ids.append(rid)
        except Exception:
            for rid in ids:
                eng.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | None = None, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False) -> list[RequestOutput]:
        """messages: one conversation (list of {"role", "content"}) or a list of conversations."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.llm_engine.tokenizer
        prompts = []
        for conv in convs:
            text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template)
            # the template writes its own special tokens (BOS...): do not add them twice
            self.llm_engine.validator.check_prompt_text(text)
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        eng = self.llm_engine
        final: dict[str, RequestOutput] = {}
        pending = set(ids)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts")
        while pending:
            outs = eng.step(finished_only=True)
            if not outs and not eng.has_unfinished_requests():
                break
            for o in outs:
                if o.finished and o.request_id in pending:
                    final[o.request_id] = o
                    pending.discard(o.request_id)
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [final[i] for i in ids]


def _copy(sp: SamplingParams) -> SamplingParams:
    import copy

    return copy.copy(sp)
