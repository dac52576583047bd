"""`pagedserve chat`: an interactive multi-turn chat in the terminal, the reply streamed token by token.

Drives LLMEngine directly (add_request, then step() until the request finishes), printing the new
part of the cumulative text after each step. The conversation (system prompt, user and assistant
turns) goes through the model's chat template each turn, exactly as `LLM.chat` does.

Commands: /exit (or /quit, or end of input) quits, /reset forgets the conversation, /help lists them.
When the conversation no longer fits max_model_len, the oldest turns are dropped (a note goes to stderr).
With stdin not a terminal (a pipe), no prompt or banner is printed: stdout then holds only the
replies, each followed by a newline.
"""
from __future__ import annotations

import sys

HELP = "commands: /exit (or /quit, Ctrl-D) quits, /reset clears the conversation, /help shows this"


def register(sub) -> None:
    from pagedserve.engine.args import add_engine_args

    p = sub.add_parser("chat", help="chat with the model in the terminal (streams the replies)",
                       description="Interactive multi-turn chat with the model, the reply streamed as it is "
                       "generated. " + HELP + ". Without --model it uses the built-in default model.")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=512, help="most tokens per reply (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    add_engine_args(p)
    p.set_defaults(func=run)


class ChatSession:
    """The conversation and the engine; `reply(user_text, write)` streams one assistant turn."""

    def __init__(self, engine, params, system: str | None = None):
        self.engine = engine
        self.params = params
        self.system = system
        self.messages: list[dict] = []
        self._n = 0

    def reset(self) -> None:
        self.messages = []

    def _conversation(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages

    def _prompt_ids(self) -> list[int]:
        tok = self.engine.tokenizer
        text = tok.apply_chat_template(self._conversation(), tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)  # the template writes its own BOS etc.

    def _fit(self, note) -> list[int]:
        """Prompt ids for the conversation, dropping the oldest turns until prompt + max_tokens fits."""
        limit = self.engine.config.max_model_len
        ids = self._prompt_ids()
        while len(ids) + self.params.max_tokens > limit and len(self.messages) > 1:
            drop = 2 if len(self.messages) > 2 else 1  # a user turn and its reply
            self.messages = self.messages[drop:]
            note(f"(the conversation is longer than max_model_len={limit} allows: dropped the oldest turn)")
            ids = self._prompt_ids()
        return ids

    def reply(self, user_text: str, write, note=lambda s: None) -> str:
        """Add the user's turn, stream the assistant's reply through write(delta), and return it."""
        import copy

        self.messages.append({"role": "user", "content": user_text})
        ids = self._fit(note)
        self._n += 1
        rid = f"chat-{self._n}"
        eng = self.engine
        try:
            eng.add_request(rid, None, copy.copy(self.params), prompt_token_ids=ids)
        except Exception:
            self.messages.pop()
            raise
        shown = ""
        try:
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.request_id != rid:
                        continue
                    text = out.outputs[0].text
                    if len(text) > len(shown):
                        write(text[len(shown):])
                        shown = text
        except BaseException:  # Ctrl-C in the middle of a reply: drop the turn
            eng.abort_request(rid)
            self.messages.pop()
            raise
        self.messages.append({"role": "assistant", "content": shown})
        return shown


def run(args) -> int:
    import logging

    from pagedserve.engine.args import config_from_args
    from pagedserve.errors import ConfigError, InvalidRequestError
    from pagedserve.sampling_params import SamplingParams

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")

    def err(msg):
        print(f"pagedserve chat: error: {msg}", file=sys.stderr, flush=True)

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, repetition_penalty=args.repetition_penalty)
        params.validate()
        config = config_from_args(args)
        from pagedserve.engine.engine import LLMEngine

        engine = LLMEngine(config)
    except (ConfigError, InvalidRequestError, RuntimeError) as e:
        err(e)
        return 2
    if not getattr(engine.tokenizer, "chat_template", None):
        err(f"{config.model} has no chat template; use `pagedserve generate` for plain completion")
        return 2

    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print(f"pagedserve chat with {config.served_model_name}. {HELP}", file=sys.stderr, flush=True)
    session = ChatSession(engine, params, args.system)

    def write(s):
        sys.stdout.write(s)
        sys.stdout.flush()

    def note(s):
        print(s, file=sys.stderr, flush=True)

    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            return 0
        if text == "/reset":
            session.reset()
            note("(conversation cleared)")
            continue
        if text in ("/help", "/?"):
            note(HELP)
            continue
        try:
            session.reply(text, write, note)
        except InvalidRequestError as e:
            err(e)
            continue
        except KeyboardInterrupt:
            write("\n")
            note("(reply interrupted)")
            continue
        write("\n")
