"""fastroute's own flags, not in sglang-router: the extensions (decode input demand, KV fit,
rank fields, ``--workers``...), service discovery and router replicas. Defaults come from
:class:`fastroute.config.Config`; :func:`fastroute.config.cli.build_parser` calls these on its parser.
"""

from __future__ import annotations

from fastroute.config.flagparse import Adder, DiscoveryOption, workers_value
from fastroute.config.settings import (
    DEMAND_MODES,
    DISCOVERY_PROVIDERS,
    DP_RANK_FIELDS,
    ENV_DECODE_REQUEST_WEIGHT,
    KV_EVENTS_MODES,
    default,
)


def add_own_groups(add: Adder) -> None:
    """The fastroute extensions, Service discovery and Router replicas groups."""
    d = default

    add.section("fastroute extensions", "Not in sglang-router; defaults keep peer behaviour.")
    add(
        "--decode-input-demand",
        choices=DEMAND_MODES,
        default=d("decode_input_demand"),
        help="Pick decode targets by in-flight input tokens + request tokens (+ W x held "
        "requests): off, shadow (count agreement, dispatch legacy pick) or on "
        "(default: %(default)s).",
    )
    add(
        "--decode-request-weight",
        type=int,
        default=None,
        metavar="W",
        help="Token charge per request a decode target already holds in the demand cost; "
        "nonzero needs --decode-input-demand shadow or on (default: $"
        + ENV_DECODE_REQUEST_WEIGHT
        + " if set, else 0).",
    )
    add(
        "--prefill-input-demand",
        choices=DEMAND_MODES,
        default=d("prefill_input_demand"),
        help="PD: pick prefill targets (ranks under --dp-aware) by the input tokens waiting "
        "there + this request's: booked at the pick, given back when the prefill answers, "
        "corrected by /v1/loads num_waiting_uncached_tokens where reported; off, shadow "
        "(count agreement, dispatch the prefill policy's pick) or on (default: %(default)s).",
    )
    add(
        "--dp-rank-field",
        choices=DP_RANK_FIELDS,
        default=None,
        help="Body key carrying the chosen DP rank (default: routed_dp_rank on the PD decode "
        "leg, data_parallel_rank in regular mode).",
    )
    add("--seed", type=int, default=None, help="Seed of the tie-break RNG, for reproducible runs (default: random).")
    add(
        "--body-read-timeout-secs",
        type=float,
        default=d("body_read_timeout_secs"),
        help="Answer 408 and close when a request body has not fully arrived within this time; "
        "a body stalled for --header-read-timeout-secs is cut sooner (default: %(default)s s).",
    )
    add(
        "--pd-max-batch-size",
        type=int,
        default=d("pd_max_batch_size"),
        help="Largest PD batch (items, one bootstrap room each); larger ones get 413 (default: %(default)s).",
    )
    add(
        "--workers",
        type=workers_value,
        default=d("workers"),
        metavar="N|auto",
        help="Proxy processes sharing the port and one in-flight ledger; auto = one per CPU (default: %(default)s).",
    )
    add(
        "--max-targets",
        type=int,
        default=d("max_targets"),
        metavar="N",
        help="Rows of the shared target table: targets (workers, or DP ranks under --dp-aware) "
        "of all workers together; a row is 192 bytes of shared memory, once more per proxy "
        "process under --workers N, checked against /dev/shm at start-up (default: "
        "%(default)s, 1,000 servers of 8 ranks).",
    )
    add(
        "--decode-kv-fit",
        choices=DEMAND_MODES,
        default=d("decode_kv_fit"),
        help="KV-fit decode placement: narrow the decode candidates to the ranks whose "
        "estimated free KV (last /v1/loads poll + the router's bookings since) holds this "
        "request's input + max_new_tokens + the reserve, then apply the decode policy (or the "
        "demand cost); no rank fits: the one with the most free KV. 'shadow' dispatches the "
        "usual pick and counts agreement (default: %(default)s).",
    )
    add(
        "--speed-aware",
        choices=DEMAND_MODES,
        default=d("speed_aware"),
        help="Mixed hardware: fit each decode server's step time against its busiest rank's "
        "requests from the gaps of the streams the router relays (and each prefill rank's "
        "tokens/s), and place a decode (or regular) request on the rank of least predicted time "
        "per output token once it is added, a prefill on the rank of least predicted queueing "
        "time; servers of equal measured speed are left to the policy. 'shadow' dispatches the "
        "usual pick and counts agreement; needs a decode policy of power_of_two, random or "
        "round_robin and one router process (default: %(default)s).",
    )
    add(
        "--speed-slo-unmet",
        choices=("best_effort", "refuse"),
        default=d("speed_slo_unmet"),
        help="With --speed-aware on, requests may carry latency targets in llm-d's headers "
        "x-slo-ttft-ms and x-slo-tpot-ms; they go to the rank predicted to meet them with the "
        "least headroom to spare. When no rank is predicted to meet them: best_effort places them "
        "as usual, refuse answers 503 slo_unattainable with Retry-After (default: %(default)s).",
    )
    add(
        "--cache-aware-rank-slack",
        type=int,
        default=d("cache_aware_rank_slack"),
        metavar="N",
        help="cache_aware on a leg that decodes (PD decode, regular): pick only among targets "
        "holding at most the least-loaded one's in-flight requests + N; a prefix hit goes to "
        "the least-loaded holder, a miss to the least-loaded target. Default: 0 on the PD "
        "decode leg under --dp-aware when it inherits --policy cache_aware (every decode "
        "step waits for the busiest rank), unbounded elsewhere and with an explicit "
        "--decode-policy cache_aware.",
    )
    add(
        "--decode-kv-reserve-tokens",
        type=int,
        default=d("decode_kv_reserve_tokens"),
        metavar="TOKENS",
        help="Extra KV tokens a request must leave free on its rank under --decode-kv-fit, "
        "on top of its input and max_new_tokens (default: %(default)s).",
    )

    add.section(
        "Tokenizer",
        "Exact token counts and token ids of text and chat prompts (smg's flags; local files only, "
        "nothing is fetched; fastroute.dataplane.tokenize).",
    )
    add(
        "--tokenizer-path",
        action="append",
        default=None,
        metavar="[MODEL=]DIR",
        help="A directory with tokenizer.json (and tokenizer_config.json for the chat template and "
        "special tokens): prompts are tokenized before the pick, so demand, KV fit, prefill demand, "
        "the token rate limit and the KV-event prefix index use exact tokens; the body sent is "
        "unchanged. Repeat as MODEL=DIR per model under --enable-igw (default: none).",
    )
    add(
        "--model-path",
        default=None,
        metavar="DIR",
        help="The model's local directory, read as --tokenizer-path when that is not given (default: none).",
    )
    add(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="A jinja chat template file used instead of the tokenizer's own (default: none).",
    )
    add(
        "--tokenize-timeout-ms",
        type=float,
        default=d("tokenize_timeout_ms"),
        metavar="MS",
        help="Longest a request waits for its prompt to be tokenized in the thread pool; past it "
        "the estimate is used and counted (default: %(default)s).",
    )
    add("--tokenizer-cache-enable-l0", action="store_true", help="Cache whole prompts' token ids (default: off).")
    add(
        "--tokenizer-cache-l0-max-entries",
        type=int,
        default=d("tokenizer_cache_l0_max_entries"),
        help="Prompts in the L0 cache at most (default: %(default)s).",
    )
    add(
        "--tokenizer-cache-l0-max-memory",
        type=int,
        default=d("tokenizer_cache_l0_max_memory"),
        metavar="BYTES",
        help="Bytes of the L0 cache at most (default: %(default)s).",
    )
    add(
        "--tokenizer-cache-enable-l1",
        action="store_true",
        help="Cache each chat prompt's ids up to its last special token, so the next turn of the "
        "conversation tokenizes only what it adds (default: off).",
    )
    add(
        "--tokenizer-cache-l1-max-memory",
        type=int,
        default=d("tokenizer_cache_l1_max_memory"),
        metavar="BYTES",
        help="Bytes of the L1 cache at most (default: %(default)s).",
    )

    add.section(
        "Engine events",
        "KV events and pushed loads per DP rank over ZMQ (SGLang 0.5.23+ with --kv-events-config; "
        "fastroute.control.kvevents).",
    )
    add(
        "--kv-events",
        choices=KV_EVENTS_MODES,
        default=d("kv_events"),
        help="auto: subscribe to every worker whose /server_info advertises kv_events (or to "
        "--kv-events-endpoint): cache_aware then places prefills (and regular requests) with "
        "input_ids by the prefix each rank reports holding and its waiting tokens, and pushed "
        "loads replace the /v1/loads poll for that rank; off: never (default: %(default)s).",
    )
    add(
        "--kv-events-endpoint",
        default=None,
        metavar="tcp://*:PORT[,replay=PORT][,load=PORT]",
        help="For workers that publish KV events without advertising them: rank r's publisher "
        "is at the worker's host, PORT + r (replay and load sockets likewise); blocks of "
        "--block-size tokens (default: none).",
    )
    add(
        "--block-size",
        type=int,
        default=d("block_size"),
        help="Tokens per KV block of the workers under --kv-events-endpoint (advertised "
        "publishers say their own) (default: %(default)s).",
    )
    add(
        "--kv-events-stale-secs",
        type=float,
        default=d("kv_events_stale_secs"),
        metavar="SECS",
        help="A rank silent this long on both its KV and load sockets is marked stale and its "
        "index cleared; a stale rank is used again after its stream has been whole this long "
        "(default: %(default)s s).",
    )
    add(
        "--kv-index-max-blocks",
        type=int,
        default=d("kv_index_max_blocks"),
        metavar="N",
        help="Blocks indexed per rank at most (about 200 bytes each); past it the oldest go (default: %(default)s).",
    )

    add.section(
        "Service discovery",
        "Workers from Kubernetes pods or a JSON manifest file, beside "
        "--worker-urls / --prefill / --decode and POST /workers (fastroute.control.discovery).",
    )
    opt = DiscoveryOption
    add(
        "--service-discovery",
        action="store_true",
        help="Watch Kubernetes pods (in-cluster service account or kubeconfig; refuses to start "
        "without either): a Running and Ready pod matching the selector becomes worker "
        "http://<podIP>:<--service-discovery-port> (default: off).",
    )
    add(
        "--selector",
        action=opt,
        nargs="*",
        default=d("selector"),
        metavar="KEY=VALUE",
        help="Label selector of regular-mode worker pods, space- or comma-separated, "
        "set-based forms allowed (default: none).",
    )
    add(
        "--prefill-selector",
        action=opt,
        nargs="*",
        default=d("prefill_selector"),
        metavar="KEY=VALUE",
        help="PD mode: label selector of prefill pods (default: none).",
    )
    add(
        "--decode-selector",
        action=opt,
        nargs="*",
        default=d("decode_selector"),
        metavar="KEY=VALUE",
        help="PD mode: label selector of decode pods (default: none).",
    )
    add(
        "--service-discovery-port",
        action=opt,
        type=int,
        default=d("service_discovery_port"),
        metavar="PORT",
        help="Worker HTTP port on each pod (default: %(default)s).",
    )
    add(
        "--service-discovery-namespace",
        action=opt,
        default=None,
        metavar="NAMESPACE",
        help="Namespace to watch (default: all namespaces).",
    )
    add(
        "--bootstrap-port-annotation",
        action=opt,
        default=d("bootstrap_port_annotation"),
        metavar="KEY",
        help="Pod annotation holding a prefill pod's KV bootstrap port; absent = null (default: %(default)s).",
    )
    add(
        "--discovery-provider",
        choices=DISCOVERY_PROVIDERS,
        default=None,
        help="Where workers come from: kubernetes pods or a JSON manifest file; giving it turns "
        "discovery on (default: kubernetes with --service-discovery).",
    )
    add(
        "--discovery-file",
        action=opt,
        default=None,
        metavar="PATH",
        help='--discovery-provider file: the manifest {"workers": [{"url": ..., '
        '"worker_type": ..., "bootstrap_port": ...}]}; may appear after start-up, '
        "re-read on change; a malformed file keeps the last good set (default: none).",
    )
    add(
        "--discovery-check-interval-secs",
        action=opt,
        type=int,
        metavar="SECS",
        default=d("discovery_check_interval_secs"),
        help="Full re-read of the manifest, and the length of one Kubernetes watch before it is "
        "resumed (default: %(default)s s).",
    )

    add.section(
        "Router replicas",
        "Several routers balancing as one: each publishes its per-target "
        "in-flight counts to Redis and adds the other live replicas' to its own, off the "
        "request path (fastroute.control.replica).",
    )
    add(
        "--replica-sync",
        default=None,
        metavar="redis://HOST:PORT[/DB]",
        help="Share in-flight load and circuit opens with the other replicas through this Redis; "
        "Redis gone: routing goes on with local counts (default: off).",
    )
    add(
        "--replica-id",
        default=None,
        metavar="ID",
        help="This replica's name in Redis (default: host:port:pid, so a restart starts clean).",
    )
    add(
        "--replica-sync-interval-ms",
        type=int,
        default=d("replica_sync_interval_ms"),
        metavar="MS",
        help="Publish and refresh the other replicas' counts every MS (default: %(default)s).",
    )
    add(
        "--replica-ttl-ms",
        type=int,
        default=d("replica_ttl_ms"),
        metavar="MS",
        help="A replica that has not published for MS drops out of the others' view (default: %(default)s).",
    )
