"""What crosses the boundary between the HTTP front end and the engine-core process.

Messages are tuples pickled with protocol 5 and sent over ZeroMQ: front ends PUSH commands to the
core's PULL socket; the core answers each front end on its ROUTER socket (the front end's DEALER
carries an identity, so several front ends can share one core).

front end -> core
  ("add", client_id, request_id, prompt_token_ids, SamplingParams, arrival_time)
  ("abort", [request_id, ...])
  ("shutdown",)
core -> front end
  ("ready", {"config": EngineConfig, "tokenizer": ..., "vocab_size": int, "stats": EngineStats, "pid": int,
             "spec", "dtype", "device", "num_blocks", "validator": what the server needs to know of the engine})
  ("startup_error", message, is_config_error)
  ("step", acks, deltas, failures, stats, step_seconds)  one message per front end per loop turn
     acks:     [(request_id, None | exception)]  the engine accepted or refused an add
     deltas:   [RequestDelta]  what each request gained in this step (not the cumulative output)
     failures: [(request_id, message)]  requests that were in a step that raised
     step_seconds: None when no step ran (commands only)

RequestDelta = (request_id, finished, [SeqDelta], prompt_logprobs_delta | None, metrics | None,
                num_cached_tokens)
SeqDelta     = (index, new_token_ids, new_logprobs | None, cumulative_logprob, finish_reason,
                stop_reason, text_delta | None)   text_delta only when the core detokenizes
"""
from __future__ import annotations

import pickle

ADD, ABORT, SHUTDOWN = "add", "abort", "shutdown"
READY, STARTUP_ERROR, STEP = "ready", "startup_error", "step"
HELLO = b"hello"


def dumps(msg) -> bytes:
    return pickle.dumps(msg, protocol=5)


def loads(data) -> object:
    return pickle.loads(data)
