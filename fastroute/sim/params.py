"""The simulated server's knobs (``SimParams``, one field per ``--flag`` of the worker CLI) and
what the simulator parses out of an inference body (``ParsedGen``, or ``BadRequest``): the
vocabulary the HTTP side (``api``, ``server``) and the engines (``engine``) share. The timing
and KV models these knobs drive are described in ``engine``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastroute.sim.dispatch import LB_METHODS, DpController


@dataclass
class SimParams:
    """Knobs of one simulated server; every field is a ``--flag`` of the worker CLI."""

    dp_size: int = 8
    model: str = "sim-model"
    max_total_num_tokens: int = 1_500_000  # per rank
    max_running_requests: int = 256  # per rank
    max_new_tokens: int = 128  # default when the request names none
    step_base_ms: float = 27.3
    step_request_ms: float = 2.0
    step_mtoken_ms: float = 4.0
    prefill_base_ms: float = 20.0
    prefill_tokens_per_s: float = 120_000.0  # per prefill rank
    chars_per_token: float = 4.0  # text -> token estimate (utf-8 bytes per token)
    time_scale: float = 1.0
    sample_interval_s: float = 0.1
    rendezvous_timeout_s: float = 120.0
    # decode KV model (see DecodeEngine)
    retract: bool = False  # over-commit output KV and retract when decoding runs out
    reserved_decode_tokens: int = 128  # output KV held back per request under --retract
    kv_transfer_tokens_per_s: float = 0.0  # prefill -> decode KV bandwidth; 0 = instant
    kv_transfer_scope: str = "server"  # one transfer channel per "server" or per "rank"
    slow_rank: int = -1  # this decode rank steps slow_factor times slower (-1: none)
    slow_factor: float = 1.0
    # mixed hardware (see engine): the whole server is this many times slower (decode steps and
    # prefill compute), and from slowdown_at seconds after it starts (-1: never) slowdown_factor
    # times slower again (thermal throttling, a noisy neighbour); prefill_rank_rates sets each
    # prefill rank's own tokens/s ("120000,60000,..."; "" = prefill_tokens_per_s on every rank)
    speed_factor: float = 1.0
    slowdown_at: float = -1.0
    slowdown_factor: float = 1.0
    prefill_rank_rates: str = ""
    # prefix cache of each prefill DP rank (see PrefillEngine): tokens it holds, 0 = no cache
    prefix_cache_tokens: int = 0
    prefix_block_tokens: int = 512  # cached in blocks of this many tokens, as SGLang's pages
    # the engine's DP controller (see dispatch): rank of a request the router names none for
    load_balance_method: str = "auto"  # auto | round_robin | follow_bootstrap_room | total_requests | total_tokens
    lb_refresh_ms: float = 20.0  # the controller re-reads the ranks' snapshots at most this often
    load_snapshot_interval: int = 15  # a decode rank publishes its snapshot every N steps (and when idle)
    # KV events and pushed loads over ZMQ, as SGLang 0.5.23 publishes them (see kvevents)
    kv_events_port_base: int = 0  # rank r publishes on base + r; 0 = off, -1 = a free range
    kv_events_replay_port_base: int = -1  # replay ROUTER of rank r on base + r; -1 = auto, 0 = off
    load_publish_port_base: int = -1  # LoadStat PUB of rank r on base + r; -1 = auto, 0 = off
    kv_events_advertise: bool = True  # the kv_events block in /server_info
    kv_events_topic: str = ""
    kv_events_buffer_steps: int = 10_000  # batches kept for replay
    # the model's tokenizer directory (as the router's --tokenizer-path): text and chat prompts are
    # tokenized as SGLang does (chat rendered with the template first), "" = 4 bytes a token
    tokenizer_path: str = ""

    def __post_init__(self) -> None:
        if self.kv_transfer_scope not in ("server", "rank"):
            raise ValueError(f"kv_transfer_scope must be server or rank, not {self.kv_transfer_scope!r}")
        if self.slow_factor <= 0:
            raise ValueError("slow_factor must be positive")
        if self.speed_factor <= 0 or self.slowdown_factor <= 0:
            raise ValueError("speed_factor and slowdown_factor must be positive")
        rates = self.rank_rates()
        if rates and (len(rates) != self.dp_size or min(rates) <= 0):
            raise ValueError(f"prefill_rank_rates needs {self.dp_size} positive rates, got {self.prefill_rank_rates!r}")
        if self.kv_events_port_base < -1 or self.kv_events_port_base > 65535:
            raise ValueError("kv_events_port_base must be -1 (a free range), 0 (off) or a port")
        for name in ("kv_events_replay_port_base", "load_publish_port_base"):
            v = getattr(self, name)
            if v < -1 or v > 65535:
                raise ValueError(f"{name} must be -1 (auto), 0 (off) or a port")
        if self.kv_events_buffer_steps < 1:
            raise ValueError("kv_events_buffer_steps must be at least 1")
        if self.load_balance_method not in LB_METHODS:
            raise ValueError(
                f"load_balance_method must be one of {', '.join(LB_METHODS)}, not {self.load_balance_method!r}"
            )

    def controller(self, role: str) -> DpController:
        """The DP controller of a server of ``role`` with these parameters."""
        return DpController(
            self.load_balance_method, role, self.dp_size, time.monotonic, self.lb_refresh_ms / 1000.0 * self.time_scale
        )

    def rank_rates(self) -> list[float]:
        """Each prefill rank's tokens/s from ``prefill_rank_rates`` ([] when not set)."""
        try:
            return [float(x) for x in self.prefill_rank_rates.split(",") if x.strip()]
        except ValueError:
            raise ValueError(
                f"prefill_rank_rates must be comma-separated numbers, not {self.prefill_rank_rates!r}"
            ) from None

    def prefill_rate(self, rank: int) -> float:
        rates = self.rank_rates()
        return rates[rank] if rates else self.prefill_tokens_per_s

    def slowness(self, since_start: float) -> float:
        """How many times slower than the nominal model the server runs ``since_start`` wall
        seconds after it started: ``speed_factor``, times ``slowdown_factor`` from ``slowdown_at``."""
        if 0 <= self.slowdown_at <= since_start:
            return self.speed_factor * self.slowdown_factor
        return self.speed_factor

    def step_seconds(self, running: int, ctx_tokens: int) -> float:
        """Step time of one rank alone; the engine takes the max over ranks plus the base."""
        return self.step_request_ms * running + self.step_mtoken_ms * ctx_tokens / 1e6


class BadRequest(Exception):
    """A request the simulator refuses, from the parser or the engine; answered 400."""


@dataclass
class ParsedGen:
    """What the simulator needs from one inference body."""

    kind: str  # "generate" | "completions" | "chat"
    stream: bool
    input_tokens: int
    max_new: int
    room: int | None
    bootstrap_host: str | None
    bootstrap_port: int | None
    rank: int | None
    return_logprob: bool
    include_usage: bool
    model: str
    index: int = 0  # position inside a batch
    batch: int | None = None  # None = scalar request, B = batch of B (protocol.md 3.3)
    items: list = field(default_factory=list)  # one scalar ParsedGen per batch item ([self] if scalar)
    blocks: tuple = ()  # chained hashes of the prompt's full blocks (prefix cache on), else ()
    token_ids: Any = None  # the prompt's token ids when ``blocks`` hash them (BlockStored carries them)
    prefill_rank: int | None = None  # disagg_prefill_dp_rank: the prefill rank holding the KV
