"""What keeps ``omlx-mtp serve`` (mlx-lm's own HTTP server, 0.31.3 and 0.32.x) up whatever a client
sends.  mlx-lm hands some malformed requests straight to its generation thread, where they kill it
(an empty prompt, ``"stop": 5``) or the process (a logit-bias token id past the logits: an
out-of-bounds index, a segfault), and lets others raise in its handler after a 200 went out.
``install`` (``hosts.mlx_lm_server``) puts these in at the seams of mlx-lm's server module:

* ``check_request``: a request's fields, checked before mlx-lm reads them; a bad one is answered
  400 with one line of JSON, ``{"error": "..."}`` (mlx-lm's shape);
* ``guarded_handler``: mlx-lm's ``APIHandler`` with those checks, a failure answered (500, or an
  error event that ends a stream) instead of raised, a client that hangs up logged in one line,
  ``/v1/models`` answered from a buffer (always JSON);
* ``guarded_generator``: mlx-lm's ``ResponseGenerator`` that loads the served model before the server
  listens (``MTPError`` if it can't) and whose loop outlives a request failing inside it;
* ``bounded_logit_bias`` and ``cache_scanner``: mlx-lm's logit-bias processor and its Hugging Face
  cache scan, without the crash.
"""

from __future__ import annotations

import io
import json
import logging
import math
import re
import threading
import weakref
from types import SimpleNamespace

import mlx.core as mx

from ..errors import MTPError

log = logging.getLogger("omlx_mtp")

TEXT_PATH = "/v1/completions"  # mlx-lm's other POST paths are chat completions
VOCABULARY = "omlx_mtp_vocabulary"  # on mlx-lm's ModelProvider: (model path, token count) once loaded

# Finite numbers in [low, high] (None: unbounded), as mlx-lm's samplers and processors take them.
NUMBERS = {"temperature": (0, None), "top_p": (0, 1), "min_p": (0, 1), "repetition_penalty": (0, None),
           "presence_penalty": (None, None), "frequency_penalty": (None, None), "xtc_probability": (0, 1),
           "xtc_threshold": (0, 1)}
# Integers (never booleans) in [low, high]; ``n``: mlx-lm answers one choice.
INTEGERS = {"max_tokens": (1, None), "max_completion_tokens": (1, None), "top_k": (0, None),
            "repetition_context_size": (0, None), "presence_context_size": (0, None),
            "frequency_context_size": (0, None), "num_draft_tokens": (0, None), "seed": (0, 2**64 - 1),
            "n": (1, 1), "top_logprobs": (-1, 11)}
BOOLEANS = ("stream", "logprobs")
STRINGS = ("model", "draft_model")
OPTIONAL = {"adapters": str, "chat_template_kwargs": dict, "role_mapping": dict, "tools": list}
TOKEN_ID = re.compile(r"[0-9]+")


class BadRequest(ValueError):
    """A request no generation should see: answered 400."""


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _in_range(name: str, value, low, high, kind: str) -> None:
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"{low}..{high}" if low is not None and high is not None else \
            f">= {low}" if low is not None else f"<= {high}"
        raise BadRequest(f"{name} must be {kind} {bounds}, got {_shown(value)}")


def check_request(body: dict, text: bool, vocabulary: int | None = None) -> dict | None:
    """Check a request's body (``text``: a text completion, else a chat completion) against what
    mlx-lm's server and generators can take; ``vocabulary``: the served model's token count, where
    known.  Raises ``BadRequest``; returns the request's ``stream_options``, completed."""
    if text:
        if not isinstance(body.get("prompt"), str) or not body["prompt"]:
            raise BadRequest("prompt must be a non-empty string")
    else:
        _check_messages(body.get("messages"))
    for name, (low, high) in NUMBERS.items():
        if body.get(name) is not None:
            if not _is_number(body[name]):
                raise BadRequest(f"{name} must be a finite number, got {_shown(body[name])}")
            _in_range(name, body[name], low, high, "a number in" if high is not None else "a number")
    for name, (low, high) in INTEGERS.items():
        value = body.get(name)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool):
                raise BadRequest(f"{name} must be an integer, got {_shown(value)}")
            if name == "n" and value != 1:
                raise BadRequest(f"n: only one choice per request is served, got {value}")
            _in_range(name, value, low, high, "an integer in" if high is not None else "an integer")
    if vocabulary is not None and isinstance(body.get("top_k"), int) and body["top_k"] >= vocabulary:
        raise BadRequest(f"top_k must be smaller than the vocabulary ({vocabulary} tokens), got {body['top_k']}")
    for name in BOOLEANS:
        if name in body and not isinstance(body[name], bool):
            raise BadRequest(f"{name} must be true or false, got {_shown(body[name])}")
    for name in STRINGS:
        if name in body and not isinstance(body[name], str):
            raise BadRequest(f"{name} must be a string, got {_shown(body[name])}")
    for name, kind in OPTIONAL.items():
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise BadRequest(f"{name} must be {'an object' if kind is dict else f'a {kind.__name__}'}, "
                             f"got {_shown(body[name])}")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and \
            not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise BadRequest(f"stop must be a string or a list of non-empty strings, got {_shown(stop)}")
    _check_logit_bias(body.get("logit_bias"), vocabulary)
    return _stream_options(body.get("stream_options"))


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"]:
            raise BadRequest(f"messages[{i}] must be an object with a role")
        content = message.get("content")
        if content is not None and not isinstance(content, str) and \
                not (isinstance(content, list) and all(isinstance(part, dict) for part in content)):
            raise BadRequest(f"messages[{i}].content must be a string or a list of content parts")


def _check_logit_bias(bias, vocabulary: int | None) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise BadRequest(f"logit_bias must be an object of token id: bias, got {_shown(bias)}")
    for key, value in bias.items():
        if not TOKEN_ID.fullmatch(key):
            raise BadRequest(f"logit_bias: {_shown(key)} is not a token id")
        if vocabulary is not None and int(key) >= vocabulary:
            raise BadRequest(f"logit_bias: token {key} is out of the vocabulary (ids 0..{vocabulary - 1})")
        if not _is_number(value):
            raise BadRequest(f"logit_bias: the bias of token {key} must be a finite number, got {_shown(value)}")


def _stream_options(options) -> dict | None:
    """mlx-lm reads ``stream_options["include_usage"]`` after the last chunk: without it, the stream
    would end without ``[DONE]``."""
    if options is None:
        return None
    if not isinstance(options, dict):
        raise BadRequest(f"stream_options must be an object, got {_shown(options)}")
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise BadRequest(f"stream_options.include_usage must be true or false, got {_shown(usage)}")
    return {**options, "include_usage": usage}


def token_count(tokenizer) -> int | None:
    """Token ids a tokenizer knows (its added tokens too): a logit bias past them is refused."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary: not checked
        return None
    return max(vocab.values()) + 1 if vocab else None


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


class _Answered(Exception):
    """The handler answered the request itself (a 400): mlx-lm's ``do_POST`` stops there."""


def guarded_handler(base):
    """``base`` (mlx-lm's ``APIHandler``) guarded: see the module's docstring."""

    class GuardedAPIHandler(base):
        _answer_started = False  # end_headers() ran: the client has a status line

        def handle(self):
            try:
                super().handle()
            except ConnectionError as exc:  # the client hung up: nothing to answer, nothing broken
                self.close_connection = True
                log.info("omlx-mtp: client %s went away during %s %s (%s)", self.client_address[0],
                         getattr(self, "command", None), getattr(self, "path", None), type(exc).__name__)

        def end_headers(self):
            super().end_headers()
            self._answer_started = True

        def do_POST(self):
            self._answer_started = False
            length = self.headers.get("Content-Length")
            if length is not None and length.strip().startswith("-"):  # read(-n) would wait for EOF
                return self._answer_error(400, "Invalid Content-Length header")
            self._guarded(super().do_POST)

        def do_GET(self):
            self._answer_started = False
            self._guarded(super().do_GET)

        def _guarded(self, method):
            try:
                method()
            except _Answered:
                pass
            except ConnectionError:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever failed, the client gets an answer
                self._failed(exc)

        def validate_model_parameters(self):
            # mlx-lm calls this once it has read the body's fields, before stop words, the
            # request object and the generator: the one point common to 0.31.3 and 0.32.x.
            try:
                self.stream_options = check_request(self.body, self.path == TEXT_PATH, self._vocabulary())
                super().validate_model_parameters()  # mlx-lm's own (0.31.3 answers them with a traceback)
            except (ValueError, TypeError) as exc:
                log.info("omlx-mtp: refused %s %s: %s", self.command, self.path, exc)
                self._answer_error(400, str(exc))
                raise _Answered from None

        def handle_models_request(self):
            # mlx-lm sends its 200 before it scans the cache: it writes to a buffer here, so that a
            # failure can still be answered.
            wfile, self.wfile = self.wfile, io.BytesIO()
            try:
                super().handle_models_request()
            except Exception:
                self._answer_started = False  # what it wrote went to the buffer only
                raise
            finally:
                answer, self.wfile = self.wfile.getvalue(), wfile
            self.wfile.write(answer)
            self.wfile.flush()

        def _vocabulary(self) -> int | None:
            provider = self.response_generator.model_provider
            loaded = getattr(provider, VOCABULARY, None)
            requested = self.body.get("model", "default_model")
            path = provider.cli_args.model if requested == "default_model" else requested
            return loaded[1] if loaded is not None and loaded[0] == path else None

        def _failed(self, exc: Exception) -> None:
            message = f"{type(exc).__name__}: {first_line(exc)}"
            log.error("omlx-mtp: %s %s failed: %s", self.command, self.path, message)
            log.debug("omlx-mtp: the failure", exc_info=exc)
            self.close_connection = True
            if not self._answer_started:
                self._headers_buffer = []  # drop the 200 mlx-lm began (send_response) but never sent
                self._answer_error(400 if isinstance(exc, UnicodeDecodeError) else 500, message)
            elif getattr(self, "stream", False):  # mid-stream: say why; the stream ends without [DONE]
                self.wfile.write(f"data: {json.dumps({'error': message})}\n\n".encode())
                self.wfile.flush()

        def _answer_error(self, status: int, message: str) -> None:
            body = (json.dumps({"error": message}) + "\n").encode()
            self._set_completion_headers(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()

    GuardedAPIHandler.__qualname__ = f"Guarded{base.__qualname__}"
    return GuardedAPIHandler


class _Tracked:
    """A request's response queue as mlx-lm's generation loop holds it, noting when the request
    ended (the loop put None or an error on it)."""

    __slots__ = ("queue", "ended", "__weakref__")

    def __init__(self, queue):
        self.queue, self.ended = queue, False

    def put(self, item, *args, **kwargs):
        self.ended = self.ended or item is None or isinstance(item, Exception)
        self.queue.put(item, *args, **kwargs)


def guarded_generator(base):
    """``base`` (mlx-lm's ``ResponseGenerator``) guarded: see the module's docstring."""

    class GuardedResponseGenerator(base):
        def __init__(self, model_provider, prompt_cache):
            self._held = weakref.WeakSet()  # _Tracked of the requests the loop took (it drops the others)
            self._loaded = threading.Event()
            self._load_error = None
            super().__init__(model_provider, prompt_cache)  # starts the generation thread
            try:
                self._loaded.wait()
            except BaseException:
                self._stop = True  # Ctrl-C while loading: the loop ends once the model is in
                raise
            if self._load_error is not None:
                self.join()
                raise MTPError(f"cannot load the model {model_provider.cli_args.model}: "
                               f"{first_line(self._load_error)}")

        def _generate(self):
            try:  # before the server listens (run() starts it after this object is made)
                self.model_provider.load_default()
            except Exception as exc:  # noqa: BLE001 - any failure to load: the server must not start
                self._load_error = exc
                return
            finally:
                self._loaded.set()
            while True:
                try:
                    return super()._generate()  # its own load_default() finds the model loaded
                except Exception as exc:
                    # Under mlx.launch every rank must run the same loop: a restart on one rank
                    # could leave the others waiting, so the loop ends there as mlx-lm's does.
                    if not self._end_held_requests(exc) or self._is_distributed:
                        raise

        def _end_held_requests(self, exc: Exception) -> bool:
            """Put the failure on every request the loop held (which one failed can't be told from
            here); False where it held none (nothing to blame: the loop ends)."""
            held = [tracked for tracked in list(self._held) if not tracked.ended]
            if not held:
                return False
            message = f"generation failed ({type(exc).__name__}: {first_line(exc)})"
            log.error("omlx-mtp: %s; %d request(s) ended%s", message, len(held),
                      "" if self._is_distributed else ", the generation loop goes on")
            log.debug("omlx-mtp: the failure", exc_info=exc)
            for tracked in held:
                tracked.put(RuntimeError(message))
            return True

        def _next_request(self, timeout=None):
            request = super()._next_request(timeout)
            if request is None:
                return None
            tracked = _Tracked(request[0])
            self._held.add(tracked)
            return (tracked, *request[1:])

        def _tokenize(self, tokenizer, request, args):
            tokenized = super()._tokenize(tokenizer, request, args)
            if not tokenized[0]:  # it would fail later, inside the batch generator, taking the loop down
                raise ValueError("the prompt has no tokens")
            return tokenized

    GuardedResponseGenerator.__qualname__ = f"Guarded{base.__qualname__}"
    return GuardedResponseGenerator


def bounded_logit_bias(bias: dict):
    """mlx-lm's logit-bias processor, except that a token id past the logits' width (an
    out-of-bounds index: a segfault) is left out, with one warning.  The served model's ids are
    checked at the request; this covers models loaded by name."""
    tokens, biases = list(bias), list(bias.values())
    made: dict = {}  # logits width -> (ids, biases), or None where none is in range

    def logit_bias_processor(_, logits):
        width = logits.shape[-1]
        if width not in made:
            kept = [(t, b) for t, b in zip(tokens, biases) if 0 <= t < width]
            if len(kept) < len(tokens):
                log.warning("omlx-mtp: logit_bias: %d token id(s) past the model's %d logits left out",
                            len(tokens) - len(kept), width)
            made[width] = (mx.array([t for t, _ in kept]), mx.array([b for _, b in kept])) if kept else None
        pair = made[width]
        return logits if pair is None else logits.at[:, pair[0]].add(pair[1])

    return logit_bias_processor


def cache_scanner(scan):
    """mlx-lm's ``scan_cache_dir`` for ``/v1/models``: no Hugging Face cache (or an unreadable one)
    lists no cached models instead of failing the request."""

    def scan_cache_dir(*args, **kwargs):
        try:
            return scan(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - huggingface_hub's CacheNotFound, OSError, ...
            log.debug("omlx-mtp: no Hugging Face cache to list (%s)", first_line(exc))
            return SimpleNamespace(repos=frozenset(), size_on_disk=0, warnings=[])

    return scan_cache_dir
