"""MTP inside mlx-lm's own HTTP server (``mlx_lm.server``, releases 0.31.3 and 0.32.x).

mlx-lm's server keeps one batch generator per loaded model: its response thread builds
``BatchGenerator(model, completion_batch_size=..., prefill_batch_size=..., prefill_step_size=...,
stream=...)``, feeds it requests with ``insert_segments``, drives it with ``next()``, ``remove``s
cancelled ones and files the caches of finished ones in its prompt cache.  ``install`` patches these
names of that module:

* ``ModelProvider``: a subclass whose ``_load`` decides, once per loaded model, whether it decodes
  with MTP (settings, drafter, mlx-lm's own modes that rule it out) and logs one line saying so;
* ``BatchGenerator``: for a model with MTP, a ``ServerMTPBatchGenerator`` (this package's decode
  loop behind the same API); for any other, mlx-lm's own;
* ``_make_sampler``: the sampler it makes, tagged with the request's sampling arguments, so the MTP
  loop rebuilds the distribution (temperature, top-p, top-k, min-p) instead of drawing one token
  per round through an opaque sampler;
* ``ResponseGenerator``, ``_run_http_server`` (its handler), ``_make_logits_processors`` and
  ``scan_cache_dir``: what keeps the server up whatever a client sends (``hosts.server_guards``:
  requests checked before they reach a generator, a failure inside generation ending its requests
  and not the generation thread, a served model that can't load refused before the server listens),
  for a model served with MTP and without alike.

mlx-lm turns batching off when *its* draft model is loaded; the drafter here is not its draft
model, so batching stays on.  Under ``mlx.launch`` mlx-lm loads the target with its own
``sharded_load`` on every rank and rank 0 shares each request with the others, so every rank
inserts the same requests in the same order; the decoder gets a ``RankGroup`` to keep their rounds
in step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import deque
from pathlib import Path

import mlx.core as mx

from ..checkpoint.loading import upcast_where_the_cpu_needs_it
from ..decode.ranks import RankGroup
from ..drafters import load_drafter, load_merged_drafter
from ..errors import MTPError
from ..targets import wrap_target
from .batch_generator import MTPBatchGenerator
from .prompt_segments import PromptProgress, StagedPrompt, split_segments
from .server_guards import (VOCABULARY, bounded_logit_bias, cache_scanner, guarded_generator, guarded_handler,
                            token_count)
from .settings import MTPSettings, load_file, validate
from .strategy import MTPStrategy

log = logging.getLogger("omlx_mtp")

SUPPORTED_MLX_LM = "0.31.3 and 0.32.x"
SETTINGS_NAME = "omlx-mtp.yaml"  # a model's settings beside its weights, in its directory
PATCHED = ("ModelProvider", "BatchGenerator", "_make_sampler", "ResponseGenerator", "_run_http_server",
           "_make_logits_processors", "scan_cache_dir")
SEAMS = (*PATCHED, "APIHandler", "main", "run")


def check_mlx_lm(version: str, server) -> None:
    """Refuse an mlx-lm release whose server this glue was not written against."""
    parts = version.split(".")
    if not (version == "0.31.3" or parts[:2] == ["0", "32"]):
        raise MTPError(f"omlx-mtp serve wraps mlx-lm {SUPPORTED_MLX_LM}'s server; this is mlx-lm {version}")
    missing = [name for name in SEAMS if not hasattr(server, name)]
    if missing or not hasattr(server.ModelProvider, "_load"):
        raise MTPError(f"mlx-lm {version}'s server lacks {', '.join(missing) or 'ModelProvider._load'}")


def model_directory(model_path: str) -> Path:
    """The local directory of a served model: the path itself, or a Hugging Face repo's cached
    snapshot (mlx-lm downloaded it when it loaded the model)."""
    path = Path(model_path)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_path, local_files_only=True))
    except Exception:  # noqa: BLE001 - huggingface_hub raises many kinds here
        raise MTPError(f"{model_path} is neither a directory nor a cached Hugging Face repo") from None


def serve_settings(directory: Path, settings_file: str | Path | None) -> tuple[MTPSettings, str]:
    """A model's MTP settings and where they come from: ``settings_file`` (``--settings``), else
    ``omlx-mtp.yaml`` in the model's directory, else none.  The keys are oMLX's model settings;
    only ``mtp_enabled`` defaults otherwise: serving with omlx-mtp means MTP unless a file says
    ``mtp_enabled: false``."""
    path = Path(settings_file) if settings_file is not None else directory / SETTINGS_NAME
    if settings_file is None and not path.is_file():
        return MTPSettings(mtp_enabled=True), "no settings file"
    return validate({"mtp_enabled": True, **load_file(path)}, str(path)), str(path)


def plan_mtp(provider, model_path: str, settings_file=None) -> tuple[MTPStrategy | None, str]:
    """(the strategy, what was loaded) for the model ``provider`` just loaded, or (None, why not)."""
    if provider.draft_model is not None:
        return None, "mlx-lm's own draft model (--draft-model) is loaded: mlx-lm decodes with it, one request at a time"
    if not provider.is_batchable:
        return None, "mlx-lm serves this model one request at a time (a cache type that does not batch)"
    if getattr(provider.cli_args, "kv_bits", None) is not None:
        return None, "--kv-bits: mlx-lm serves every request alone, on a quantized KV cache"
    directory = model_directory(model_path)
    settings, source = serve_settings(directory, settings_file)
    if not settings.mtp_enabled:
        return None, f"mtp_enabled is false ({source})"
    model = provider.model
    group = mx.distributed.init()
    ranks = None
    if group.size() > 1:  # mlx-lm's sharded_load split the trunk over the ranks
        model.omlx_mtp_sharding = "pipeline" if provider.pipeline_group is not None else "tensor"
        ranks = RankGroup(group)
    target = wrap_target(model)
    if settings.mtp_drafter:
        drafter_dir = Path(settings.mtp_drafter)
        drafter_dir = drafter_dir if drafter_dir.is_absolute() else directory / drafter_dir
        drafter, where = load_drafter(drafter_dir, target), f"drafter {drafter_dir}"
    else:
        drafter, where = load_merged_drafter(directory, target), "the checkpoint's own drafter"
        if drafter is None:
            return None, f"{directory} has neither a built-in MTP head nor a merged assistant, and mtp_drafter is not set"
    strategy = MTPStrategy.build(model, drafter, settings, target=target, ranks=ranks)
    placement = f", {ranks.size} ranks ({model.omlx_mtp_sharding})" if ranks else ""
    return strategy, f"{where} ({type(drafter).__name__}), {strategy.describe()}{placement}; settings: {source}"


class RequestSampler:
    """mlx-lm's sampler for one request, carrying the request's sampling arguments
    (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``xtc_probability``) for the MTP loop."""

    def __init__(self, sampler, sampling_params):
        self.sampler, self.sampling_params = sampler, sampling_params

    def __call__(self, logits):
        return self.sampler(logits)


class ServerMTPBatchGenerator(MTPBatchGenerator):
    """``MTPBatchGenerator`` with the rest of the API mlx-lm's server drives: ``insert_segments``
    (a prompt in segments is prefilled a chunk per step, each segment's end reported, its cache
    there handed out by ``extract_cache``: ``prompt_segments``), ``next()`` as (prompt progress,
    generation responses), and ``prompt_cache_nbytes``."""

    def __init__(self, decoder, plain_factory, **kwargs):
        super().__init__(decoder, plain_factory, **kwargs)
        self._stream = kwargs.get("stream")
        self._prefill_step = kwargs.get("prefill_step_size") or 2048
        self._staged: deque = deque()  # StagedPrompt: prompts in segments, prefilled a chunk per step

    def insert_segments(self, segments, max_tokens=None, caches=None, all_tokens=None, samplers=None,
                        logits_processors=None, state_machines=None, stop_sequences=None):
        uids = []
        for i, parts in enumerate(segments):
            parts = split_segments(parts)
            prompt = [token for part in parts for token in part]
            cache = caches[i] if caches else None
            done = list(all_tokens[i]) if all_tokens else []
            if not prompt:  # the prompt cache held the whole prompt: feed its last token again
                prompt, cache, done = _refeed_last(cache, done)
                parts = split_segments([prompt])
            sampler = samplers[i] if samplers else None
            (uid,) = self.insert(
                [prompt], max_tokens=[max_tokens[i]] if max_tokens else None, caches=[cache] if cache else None,
                all_tokens=[done], samplers=[getattr(sampler, "sampler", sampler)],
                logits_processors=[logits_processors[i]] if logits_processors else None,
                state_machines=[state_machines[i]] if state_machines else None,
                stop_sequences=[stop_sequences[i]] if stop_sequences else None,
                sampling_params=[getattr(sampler, "sampling_params", None)])
            if len(parts) > 1:  # segment ends to report: taken from the queue, prefilled chunk by chunk
                self._staged.append(StagedPrompt(self._pending.pop(), parts[:-1], parts[-1]))
            uids.append(uid)
        return uids

    def next(self):
        with mx.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            responses = self.next_generated()  # decoding first, as mlx-lm's generator does
            progress = self._prefill_staged()
        return progress, responses

    def _prefill_staged(self) -> list:
        """One chunk of the oldest prompt in segments, or, once only its last token is left, its
        hand-over to the queue that starts decoding; nothing while the batch is full."""
        if not self._staged or len(self.batch.rows) + len(self._pending) >= self.completion_batch_size:
            return []
        staged = self._staged[0]
        uid = staged.pending.uid
        if not staged.parts:
            self._staged.popleft()
            self._pending.append(staged.handed_over())
            return [PromptProgress(uid, (staged.total, staged.total), True, True)]
        if staged.cache is None:
            try:
                staged.cache = self.own_cache_for(staged.pending)
            except MTPError:  # its admission falls back to the host's loop and says why
                self._staged.popleft()
                self._pending.append(staged.pending)
                return []
        chunk, ended = staged.take(self._prefill_step)
        staged.previous = self.decoder.prefill_part(chunk, staged.cache, staged.previous, settle=True)
        return [PromptProgress(uid, (len(staged.fed), staged.total), ended, False)]

    def extract_cache(self, uids) -> dict:
        """As the base class, and for a prompt in segments the cache at the segment end it just
        reported, with the tokens it holds (the server files it under them)."""
        wanted = set(uids)
        staged = {s.pending.uid: s for s in self._staged if s.pending.uid in wanted}
        out = super().extract_cache([uid for uid in uids if uid not in staged])
        for uid, s in staged.items():
            out[uid] = (self.decoder.to_host(s.cache), s.tokens) if s.cache is not None else \
                (s.pending.cache, s.pending.all_tokens)
        return out

    def remove(self, uids, return_prompt_caches=False):
        out = super().remove(uids, return_prompt_caches)  # its extract_cache is this class's
        gone = set(uids)
        self._staged = deque(s for s in self._staged if s.pending.uid not in gone)
        return out

    @property
    def prompt_cache_nbytes(self) -> int:
        """Bytes of the host caches still waiting here (running rows keep this loop's own caches)."""
        waiting = list(self._pending) + [s.pending for s in self._staged if s.cache is None]
        total = sum(c.nbytes for p in waiting for c in (p.cache or []))
        return total + (self._plain.prompt_cache_nbytes if self._plain is not None else 0)


def _refeed_last(cache, tokens: list) -> tuple[list, list | None, list]:
    """(prompt, cache, tokens) for a prompt held whole by ``cache``: the last token comes off the
    cache and is fed again (a cache that can't be trimmed is dropped: the prompt prefills anew)."""
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    if cache and tokens and can_trim_prompt_cache(cache):
        trim_prompt_cache(cache, 1)
        return tokens[-1:], cache, tokens[:-1]
    return tokens, None, []


class Installation:
    """The patched names of one ``mlx_lm.server`` module, and the strategies of its loaded models."""

    def __init__(self, server, settings_file=None, served_model: str | None = None):
        self.server = server
        self.settings_file = settings_file
        self.served_model = served_model
        self.strategies: dict[int, tuple[object, MTPStrategy]] = {}  # id(model) -> (model, strategy)
        self.saved = {name: getattr(server, name) for name in PATCHED}

    def apply(self) -> None:
        self.server.ModelProvider = _provider_class(self.saved["ModelProvider"], self)
        self.server.BatchGenerator = self.batch_generator
        self.server._make_sampler = self.make_sampler
        self.server.ResponseGenerator = guarded_generator(self.saved["ResponseGenerator"])
        self.server._run_http_server = self.run_http_server
        self.server._make_logits_processors = self.make_logits_processors
        self.server.scan_cache_dir = cache_scanner(self.saved["scan_cache_dir"])

    def restore(self) -> None:
        for name, value in self.saved.items():
            setattr(self.server, name, value)

    def strategy_for(self, model) -> MTPStrategy | None:
        entry = self.strategies.get(id(model))
        return entry[1] if entry is not None and entry[0] is model else None

    def batch_generator(self, model, **kwargs):
        """What mlx-lm's response thread calls as ``BatchGenerator(model, ...)``."""
        plain = self.saved["BatchGenerator"]
        strategy = self.strategy_for(model)
        if strategy is None:
            return plain(model, **kwargs)
        return ServerMTPBatchGenerator(strategy.decoder, plain, model=model, counters=strategy.stats, **kwargs)

    def make_sampler(self, args, tokenizer):
        return RequestSampler(self.saved["_make_sampler"](args, tokenizer), args.sampling)

    def make_logits_processors(self, args):
        """mlx-lm's processors for a request, its logit bias bounded by the logits' width."""
        bias = args.logits.logit_bias
        if not bias:
            return self.saved["_make_logits_processors"](args)
        rest = dataclasses.replace(args, logits=dataclasses.replace(args.logits, logit_bias=None))
        return [bounded_logit_bias(bias), *self.saved["_make_logits_processors"](rest)]

    def run_http_server(self, host, port, response_generator, server_class=None, handler_class=None):
        """What mlx-lm's ``run()`` calls (with no handler class of its own): its HTTP server with
        the guarded handler."""
        handler = guarded_handler(handler_class or self.server.APIHandler)
        extra = {"server_class": server_class} if server_class is not None else {}
        return self.saved["_run_http_server"](host, port, response_generator, handler_class=handler, **extra)

    def loaded(self, provider, model_path: str) -> None:
        """Decide MTP for the model ``provider`` just loaded; one log line says what and why."""
        self.strategies.clear()
        settings_file = self.settings_file if model_path == self.served_model else None
        try:
            strategy, note = plan_mtp(provider, model_path, settings_file)
        except MTPError as exc:
            strategy, note = None, str(exc)
        except Exception as exc:  # noqa: BLE001 - a drafter that fails to build: the model still serves
            strategy, note = None, f"the drafter could not be set up ({type(exc).__name__}: {exc})"
        strategy, note = _agreed(strategy, note)
        if strategy is None:
            log.warning("omlx-mtp: MTP off for %s: %s; mlx-lm serves it plainly", model_path, note)
            return
        self.strategies[id(provider.model)] = (provider.model, strategy)
        log.info("omlx-mtp: MTP on for %s: %s", model_path, note)


def _agreed(strategy, note: str) -> tuple[MTPStrategy | None, str]:
    """Under ``mlx.launch`` every rank must run the same loop: MTP stays on only where every rank
    could set it up (a rank left plain would wait in collectives the others never make)."""
    group = mx.distributed.init()
    if group.size() == 1:
        return strategy, note
    ready = mx.distributed.all_sum(mx.array(int(strategy is not None)), group=group, stream=mx.cpu).item()
    if ready == group.size():
        return strategy, note
    if strategy is not None:
        note = f"{group.size() - ready} of {group.size()} ranks could not set MTP up (their logs say why)"
    return None, note


def _provider_class(base, installation: Installation):
    class MTPModelProvider(base):
        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            installation.strategies.clear()  # the previous model goes
            setattr(self, VOCABULARY, None)
            super()._load(model_path, adapter_path, draft_model_path)
            upcast_where_the_cpu_needs_it(self.model, str(model_path))  # as generate: a bf16 MoE on a CPU
            # Read here, in the generation thread: the HTTP threads check logit biases against it.
            setattr(self, VOCABULARY, (model_path, token_count(self.tokenizer)))
            installation.loaded(self, model_path)

    MTPModelProvider.__qualname__ = f"MTP{base.__qualname__}"
    return MTPModelProvider


@contextlib.contextmanager
def install(server=None, settings_file=None, served_model: str | None = None):
    """Patch ``server`` (default: ``mlx_lm.server``) while the block runs.  ``settings_file``: the
    MTP settings of ``served_model`` (the ``--model`` it serves); other models it loads by name
    read ``omlx-mtp.yaml`` in their own directory."""
    import mlx_lm

    if server is None:
        import mlx_lm.server as server
    check_mlx_lm(mlx_lm.__version__, server)
    installation = Installation(server, settings_file, served_model)
    installation.apply()
    try:
        yield installation
    finally:
        installation.restore()
