"""Verification of draft tokens: one LM-head pass over every draft position, exact acceptance.

A sequence with drafts d_1..d_K ran K + 1 positions in the target's forward; position j gives
the target's distribution p_j for the token after d_1..d_j. The request's own sampling rules
(penalties and min_tokens masks that see the drafts before j as output, temperature, top-k,
top-p, min-p) shape p_j exactly as the sampler would for that token.

- greedy rows: d_j is accepted while it equals argmax p_j; the first mismatch is replaced by the
  argmax (so the output is token for token the one without speculation).
- sampled rows: the drafts come from deterministic proposers, so the draft distribution q is
  one-hot. The rejection rule (accept with min(1, p/q), else resample from the normalised
  (p - q)+) becomes: accept d_j with probability p_j(d_j); on rejection draw from p_j with d_j
  removed. Every emitted token then follows p exactly.
After K accepted drafts the last position gives one more token (the "bonus"), drawn from p_K.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.runner.sampler import SampledToken, SamplingBatch, _argmax


@dataclass
class Verdict:
    tokens: list[SampledToken]  # accepted drafts, then the target's token at the first rejection (or the bonus)
    num_accepted: int  # drafts accepted
    num_drafts: int


class DraftPosition:
    """A sequence as the sampler sees it at one draft position: the drafts before it count as output."""

    __slots__ = ("seq", "extra")

    def __init__(self, seq, extra: list[int]):
        self.seq = seq
        self.extra = extra

    @property
    def params(self):
        return self.seq.params

    @property
    def matcher(self):
        # constrained sequences get no drafts (decoder.propose): their only position is the bonus one,
        # where the matcher's state is the sequence's own
        assert self.seq.matcher is None or not self.extra
        return self.seq.matcher

    @property
    def index(self):
        return self.seq.index

    @property
    def prompt_len(self):
        return self.seq.prompt_len

    @property
    def token_ids(self):
        return self.seq.token_ids + self.extra

    @property
    def output_token_ids(self):
        return self.seq.output_token_ids + self.extra

    @property
    def num_output_tokens(self):
        return self.seq.num_output_tokens + len(self.extra)

    @property
    def generator(self):  # seeded requests draw from their sequence's one generator
        return self.seq.generator

    @generator.setter
    def generator(self, g):
        self.seq.generator = g


def verify(model, sampler, hidden: torch.Tensor, seqs: list, vocab_size: int, device, screen=None) -> list[Verdict]:
    """hidden: the target's hidden states at every position of every sequence's drafts, in order
    (K_i + 1 rows for sequence i: its last token, then each draft). `screen`: the runner's greedy
    LM-head screen, if any (argmax-only batches). Returns one Verdict per sequence."""
    views, drafts = [], []
    for s in seqs:
        d = s.spec_token_ids
        views.extend(DraftPosition(s, d[:j]) for j in range(len(d) + 1))
        drafts.extend(d)
        drafts.append(-1)  # the bonus position has no draft
    batch = SamplingBatch(views, vocab_size, device)
    draft_t = torch.tensor(drafts, device=device)
    has_draft = draft_t >= 0
    raw_logprobs = None
    if batch.argmax_only:
        chosen = screen.argmax(hidden) if screen is not None else _argmax(model.compute_logits(hidden, upcast=False))
        accept = chosen == draft_t
    else:
        logits = model.compute_logits(hidden)
        if batch.max_logprobs >= 0:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        sampler.adjust_logits(logits, batch)
        greedy = _argmax(logits)
        if batch.all_greedy:
            chosen, accept = greedy, greedy == draft_t
        else:
            chosen, accept = _rejection_sample(sampler, logits, batch, draft_t, has_draft)
            chosen = torch.where(batch.greedy_rows, greedy, chosen)
            accept = torch.where(batch.greedy_rows, greedy == draft_t, accept)
    tokens = [SampledToken(t) for t in chosen.tolist()]
    if raw_logprobs is not None:
        sampler._fill_logprobs(tokens, raw_logprobs, chosen, batch)
    accept_l = accept.tolist()
    verdicts, row = [], 0
    for s in seqs:
        k = len(s.spec_token_ids)
        out = []
        for j in range(k + 1):
            out.append(tokens[row + j])  # chosen == the draft where accepted
            if j == k or not accept_l[row + j]:
                break
        verdicts.append(Verdict(out, len(out) - 1, k))
        row += k + 1
    return verdicts


def _rejection_sample(sampler, logits, batch: SamplingBatch, draft_t, has_draft):
    """Sampled rows: accept the (one-hot) draft with probability p(d); else draw from p without d."""
    probs = sampler.probs(logits, batch)
    probs = probs / probs.sum(dim=-1, keepdim=True)  # min-p leaves rows unnormalised
    safe = draft_t.clamp(min=0)[:, None]
    p_draft = probs.gather(1, safe).squeeze(1)
    accept = (sampler.uniform(len(draft_t), batch, probs.device) < p_draft) & has_draft
    residual = probs.scatter(1, safe, torch.where(has_draft, 0.0, p_draft)[:, None])  # (p - q)+ for one-hot q
    # a draft holding all the mass (up to rounding) is always right: there is nothing to resample
    accept |= has_draft & (residual.sum(dim=-1) <= 0)
    resampled = (residual / sampler.exponential_noise(residual, batch)).argmax(dim=-1)
    return torch.where(accept, draft_t, resampled), accept
