"""The Envoy bootstrap that ``fastroute epp --print-envoy-config`` prints.

One listener (``--envoy-listen-port``) with an HTTP connection manager whose filter chain is
ext_proc (to the picker at 127.0.0.1:``--grpc-port`` over HTTP/2) then the router, and one
ORIGINAL_DST cluster that sends each request to the address in the
``x-gateway-destination-endpoint`` header the picker set. The ext_proc processing mode asks
for what the picker needs and no more: the request headers, the request body buffered (model,
tokens, the DP rank spliced into it), the response headers (they show the picker that a picked
stream is alive: ``--silent-stream-timeout-secs``), and the response trailers. Trailers come only when the
response has some (Envoy 1.40 synthesises none for an HTTP/1.1 worker), but asking for them keeps
the ext_proc stream open until the response ends; Envoy closes the stream when the HTTP stream is
done (complete, reset, client gone), which is where the picker releases the lease, with no
message per streamed chunk. The filter forwards the request's ``envoy.lb.subset_hint`` metadata
(the endpoints a gateway allows for this request) and accepts the picker's ``envoy.lb``. When a
pick needs no body the picker answers the headers and overrides the mode so that Envoy skips
the body (``allow_mode_override``). Streams are not timed out by Envoy (route timeout 0): the
router's own ``--request-timeout-secs`` bounds a lease.

The proxy's client-side and worker-side connection flags act here, where Envoy owns the
connections: ``--header-read-timeout-secs`` is the connection manager's request headers timeout,
``--body-read-timeout-secs`` its request timeout (plus the picker's answer time, since Envoy
counts the wait for the pick in it), ``--idle-connection-timeout-secs`` its connection idle
timeout, ``--upstream-pool-idle-timeout-secs`` the worker cluster's (0: one request per worker
connection, none kept idle), and ``--max-payload-size`` (default here 32 MiB, :func:`body_limit`)
the buffer limit, the same limit the picker's gRPC listener and its 413 use: a body over it with
a Content-Length is refused by the picker at the headers, or by Envoy when its buffer overflows
first; every such 413 has the picker's JSON error body (the local reply mapper below).
"""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import urlsplit

from fastroute.config import default
from fastroute.epp.options import FAIL_CLOSE, FAIL_OPEN, GrpcTls

HEADER = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"
# Where a gateway puts the endpoints a request may go to (the endpoint picker protocol's subset
# hint); the printed ext_proc filter forwards that namespace to the picker.
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# --fallback-endpoints (fastroute.epp.fallback): where Envoy's override_host policy writes the
# endpoint that served, forwarded to the picker with the response headers; the picked route
# retries only when the worker did not take the request, so a POST never runs twice.
SERVED_KEY = "x-gateway-destination-endpoint-served"
# --epp-mode http with --workers N (fastroute.epp.leaseslots): the picker names the lease in this
# namespace of its answer's metadata; Envoy forwards it back with the response headers, to
# whichever picker process gets that call.
LEASE_NAMESPACE = "fastroute.lease"
RETRY_ON = "connect-failure,refused-stream,reset-before-request"
EPP_CLUSTER = "fastroute_epp"
ENDPOINTS_CLUSTER = "fastroute_endpoints"
FALLBACK_CLUSTER = "fastroute_fallback"
# The largest request body Envoy buffers for the picker and the picker accepts (larger ones get
# 413), unless --max-payload-size says otherwise (body_limit()).
BODY_LIMIT = 32 * 1024 * 1024
# --workers N (N > 1): ext_proc streams Envoy opens per connection to the picker, so that its
# streams take several connections, which the kernel spreads over the picker processes
# (SO_REUSEPORT balances connections, not streams).
STREAMS_PER_CONNECTION = 8

_ADMIN = """admin:
  address:
    socket_address: {{address: 127.0.0.1, port_value: {admin}}}
"""

_TEMPLATE = """# Envoy bootstrap for fastroute's endpoint picker (fastroute epp --print-envoy-config).
{admin}static_resources:
  listeners:
  - name: fastroute_gateway
    address:
      socket_address: {{address: {listen_host}, port_value: {listen}}}
    per_connection_buffer_limit_bytes: {body_limit}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: fastroute_gateway
          stream_idle_timeout: {idle}s
          request_headers_timeout: {header_timeout}s
          request_timeout: {request_timeout}s
          common_http_protocol_options:
            idle_timeout: {conn_idle}s
          local_reply_config:
            mappers:
            # A 413 of Envoy's own (its buffer overflowed before the picker answered) in the
            # picker's JSON shape; the picker's own 413 says the same.
            - filter:
                status_code_filter:
                  comparison: {{op: EQ, value: {{default_value: 413, runtime_key: fastroute.epp.payload_status}}}}
              headers_to_add:
              - header: {{key: x-smg-error-code, value: payload_too_large}}
                append_action: OVERWRITE_IF_EXISTS_OR_ADD
              body_format_override:
                content_type: application/json
                json_format:
                  error:
                    type: invalid_request_error
                    code: payload_too_large
                    message: "Request body exceeds the limit of {body_limit} bytes"
                    param: null
          route_config:
            name: fastroute_routes
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
{routes}
          http_filters:
{strip}          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
{ext_proc_service}              failure_mode_allow: {fail_open}
{route_cache}              allow_mode_override: true
              message_timeout: {message_timeout}s
              processing_mode:
                request_header_mode: SEND
                request_body_mode: {request_body_mode}
                request_trailer_mode: SKIP
                response_header_mode: SEND
                response_body_mode: NONE
                response_trailer_mode: {response_trailer_mode}
              metadata_options:
                forwarding_namespaces:
                  untyped: [{forwarded}]
                receiving_namespaces:
                  untyped: [{received}]
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: {epp}
    type: STATIC
    connect_timeout: 2s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          {epp_protocol}
{epp_tls}    load_assignment:
      cluster_name: {epp}
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {{address: 127.0.0.1, port_value: {grpc}}}
{endpoints_cluster}{fallback}"""

# The workers' cluster without fallback endpoints: the one address of the picker's header.
_ORIGINAL_DST = """  - name: {endpoints}
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 5s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http_protocol_options: {{}}
        common_http_protocol_options:
{upstream_pool}
    original_dst_lb_config:
      use_http_header: true
      http_header_name: {header}
"""

# The ext_proc filter's service: the picker's gRPC stream, or (--epp-mode http) its HTTP/1.1
# listener, one POST per processing step (fastroute.epp.httpmode).
_GRPC_SERVICE = """              grpc_service:
                envoy_grpc: {{cluster_name: {epp}}}
                timeout: {timeout}s
"""
_HTTP_SERVICE = """              http_service:
                http_service:
                  http_uri: {{uri: "http://127.0.0.1:{port}/process", cluster: {epp}, timeout: {timeout}s}}
"""

_PICKED_ROUTE = """              - match: {{prefix: "/"{only_picked}}}
                route:
                  cluster: {endpoints}
                  timeout: 0s{retry}"""

# FailOpen: the picked route matches the picker's envoy.lb metadata, which no client can set; a
# request the picker did not answer (down, timed out) has none and takes this route to the
# fallback cluster: the --worker-urls, round robin.
_FALLBACK_ROUTE = """
              - match: {{prefix: "/"}}
                route:
                  cluster: {fallback}
                  timeout: 0s"""

# FailOpen: a client's own endpoint header is removed before the picker runs, so that with the
# picker down no client can steer a request to an address of its choosing.
_STRIP = """          - name: envoy.filters.http.header_mutation
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation
              mutations:
                request_mutations:
                - remove: {header}
"""

# --envoy-grpc-ca-path: Envoy speaks TLS to the picker, checks its certificate against the CA
# and, with --envoy-grpc-cert-path/--envoy-grpc-key-path, presents a client certificate.
_EPP_TLS = """    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context:
          alpn_protocols: [h2]
          validation_context:
            trusted_ca: {{filename: {ca}}}
{client_cert}"""

_CLIENT_CERT = """          tls_certificates:
          - certificate_chain: {{filename: {cert}}}
            private_key: {{filename: {key}}}
"""

_FALLBACK_CLUSTER = """  - name: {fallback}
    type: STRICT_DNS
    lb_policy: ROUND_ROBIN
    connect_timeout: 5s
    load_assignment:
      cluster_name: {fallback}
      endpoints:
      - lb_endpoints:
{endpoints}
"""

_FALLBACK_ENDPOINT = """        - endpoint:
            address:
              socket_address: {{address: {host}, port_value: {port}}}"""


def envoy_bootstrap(
    grpc_port: int,
    listen_port: int,
    admin_port: int | None = None,
    *,
    listen_host: str = "0.0.0.0",
    message_timeout: float = 10.0,
    idle_timeout: float = 1800.0,
    header_timeout: float = 30.0,
    body_timeout: float = 300.0,
    conn_idle_timeout: float = 60.0,
    upstream_idle_timeout: float = 3.0,
    body_limit: int = BODY_LIMIT,
    fallback: list[tuple[str, int]] | None = None,
    grpc_tls: GrpcTls | None = None,
    next_best: int = 0,
    workers: list[tuple[str, int]] | None = None,
    processes: int = 1,
    mode: str = "grpc",
) -> str:
    """The bootstrap YAML (see module docstring). ``message_timeout``: how long Envoy waits for
    one answer of the picker (a request queued by --max-concurrent-requests waits in it);
    ``idle_timeout``: Envoy's stream idle timeout (the router's request timeout); the others
    are the proxy's connection flags of the same meaning (the defaults are theirs).
    ``fallback``: FailOpen's (host, port) list; None: FailClose. ``grpc_tls``: Envoy's side of
    TLS to the picker (None: plain HTTP/2 on loopback). ``next_best``: --fallback-endpoints
    (0: the ORIGINAL_DST cluster; N: the ``workers`` (host, port) under override_host, N
    retries on the picked route; :mod:`fastroute.epp.fallback`). ``processes``: the picker's
    --workers (more than one: STREAMS_PER_CONNECTION streams per connection to it). ``mode``:
    --epp-mode (http: the picker's HTTP/1.1 listener, headers only, no trailers asked)."""
    admin = _ADMIN.format(admin=int(admin_port)) if admin_port is not None else ""
    if upstream_idle_timeout > 0:
        pool = "          idle_timeout: %ss" % _secs(upstream_idle_timeout)
    else:  # the proxy's 0: no idle worker connection is kept, one request per connection
        pool = "          max_requests_per_connection: 1"
    forwarded = '"%s"' % SUBSET_NAMESPACE
    if next_best > 0:
        retry = retry_policy(next_best)
        forwarded += ', "%s"' % METADATA_NAMESPACE  # the served report (SERVED_KEY)
        cluster = overriding_cluster(ENDPOINTS_CLUSTER, workers or [], pool, METADATA_NAMESPACE, HEADER)
    else:
        retry = ""
        cluster = _ORIGINAL_DST.format(endpoints=ENDPOINTS_CLUSTER, upstream_pool=pool, header=HEADER)
    received = '"%s"' % METADATA_NAMESPACE
    if mode == "http":  # whatever --workers the picker runs with: a lease id comes back
        forwarded += ', "%s"' % LEASE_NAMESPACE
        received += ', "%s"' % LEASE_NAMESPACE
    if fallback:
        routes = _PICKED_ROUTE.format(
            only_picked=", dynamic_metadata: [{filter: %s, path: [{key: %s}], value: {present_match: true}}]"
            % (METADATA_NAMESPACE, HEADER),
            endpoints=ENDPOINTS_CLUSTER,
            retry=retry,
        ) + _FALLBACK_ROUTE.format(fallback=FALLBACK_CLUSTER)
        strip = _STRIP.format(header=HEADER)
        route_cache = "              route_cache_action: CLEAR\n"
        hosts = "\n".join(_FALLBACK_ENDPOINT.format(host=h, port=int(p)) for h, p in fallback)
        tail = _FALLBACK_CLUSTER.format(fallback=FALLBACK_CLUSTER, endpoints=hosts)
    else:
        routes = _PICKED_ROUTE.format(only_picked="", endpoints=ENDPOINTS_CLUSTER, retry=retry)
        strip = route_cache = tail = ""
    epp_tls = ""
    if grpc_tls is not None and grpc_tls.ca is not None:
        client = ""
        if grpc_tls.cert is not None and grpc_tls.key is not None:
            client = _CLIENT_CERT.format(cert=_quoted(grpc_tls.cert), key=_quoted(grpc_tls.key))
        epp_tls = _EPP_TLS.format(ca=_quoted(grpc_tls.ca), client_cert=client)
    return _TEMPLATE.format(
        epp_tls=epp_tls,
        routes=routes,
        strip=strip,
        route_cache=route_cache,
        fail_open="true" if fallback else "false",
        fallback=tail,
        admin=admin,
        listen_host=listen_host,
        listen=int(listen_port),
        grpc=int(grpc_port),
        epp=EPP_CLUSTER,
        endpoints=ENDPOINTS_CLUSTER,
        header=HEADER,
        received=received,
        forwarded=forwarded,
        endpoints_cluster=cluster,
        epp_protocol="http_protocol_options: {}"
        if mode == "http"
        else "http2_protocol_options: {%s}"
        % ("max_concurrent_streams: %d" % STREAMS_PER_CONNECTION if processes > 1 else ""),
        ext_proc_service=(_HTTP_SERVICE if mode == "http" else _GRPC_SERVICE).format(
            epp=EPP_CLUSTER, port=int(grpc_port), timeout=_secs(message_timeout)
        ),
        request_body_mode="NONE" if mode == "http" else "BUFFERED",
        response_trailer_mode="SKIP" if mode == "http" else "SEND",
        body_limit=int(body_limit),
        message_timeout=_secs(message_timeout),
        idle=_secs(idle_timeout),
        header_timeout=_secs(header_timeout),
        request_timeout=_secs(body_timeout + message_timeout),
        conn_idle=_secs(conn_idle_timeout),
    )


def body_limit(config: Any) -> int:
    """The request body limit of the gateway: ``--max-payload-size`` when given, else
    :data:`BODY_LIMIT`. Envoy's buffers in the printed bootstrap, the picker's gRPC receive limit
    and its 413 all use it."""
    limit = int(config.max_payload_size)
    return BODY_LIMIT if limit == default("max_payload_size") else limit


def bootstrap_for(
    config: Any,
    grpc_port: int,
    listen_port: int,
    admin_port: int | None = None,
    failure_mode: str = FAIL_CLOSE,
    grpc_tls: GrpcTls | None = None,
    next_best: int = 0,
    mode: str = "grpc",
) -> str:
    """The bootstrap for a router configuration: its admission and connection flags,
    ``failure_mode`` (FailOpen falls back to the --worker-urls, round robin), Envoy's side of
    TLS to the picker (``--envoy-grpc-*``) and ``--fallback-endpoints`` (``next_best``)."""
    queued = config.max_concurrent_requests > 0 or bool(config.rate_limit_tokens_per_second)
    return envoy_bootstrap(
        grpc_port,
        listen_port,
        admin_port,
        message_timeout=config.queue_timeout_secs + 5.0 if queued else 10.0,
        idle_timeout=float(config.request_timeout_secs),
        header_timeout=float(config.header_read_timeout_secs),
        body_timeout=float(config.body_read_timeout_secs),
        conn_idle_timeout=float(config.idle_connection_timeout_secs),
        upstream_idle_timeout=float(config.upstream_pool_idle_timeout_secs),
        body_limit=body_limit(config),
        fallback=fallback_endpoints(config.worker_urls) if failure_mode == FAIL_OPEN else None,
        grpc_tls=grpc_tls,
        next_best=next_best,
        workers=fallback_endpoints(config.worker_urls) if next_best > 0 else None,
        processes=max(1, int(config.workers)),
        mode=mode,
    )


def fallback_endpoints(worker_urls: list[str]) -> list[tuple[str, int]]:
    """(host, port) of each ``http://`` worker URL, for FailOpen's fallback cluster."""
    out = []
    for url in worker_urls:
        parts = urlsplit(url.strip())
        host = parts.hostname or ""
        out.append((host, parts.port or 80))
    return out


def _quoted(path: str) -> str:
    """A file path as a YAML double-quoted scalar (JSON's escaping is valid YAML)."""
    return json.dumps(os.path.abspath(path))


def _secs(value: float) -> str:
    text = ("%.3f" % float(value)).rstrip("0").rstrip(".")
    return text or "0"


def retry_policy(n: int) -> str:
    """The picked route's retry policy: one retry per fallback endpoint, only when the worker
    did not take the request."""
    return '\n                  retry_policy: {retry_on: "%s", num_retries: %d}' % (RETRY_ON, int(n))


_CLUSTER = """  - name: {name}
    type: STRICT_DNS
    connect_timeout: 5s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http_protocol_options: {{}}
        common_http_protocol_options:
{upstream_pool}
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - metadata: {{key: {namespace}, path: [{{key: {header}}}]}}
            selected_host_key: {{key: {namespace}, path: [{{key: {served}}}]}}
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin
    load_assignment:
      cluster_name: {name}
      endpoints:
      - lb_endpoints:
{endpoints}
"""

_ENDPOINT = """        - endpoint:
            address:
              socket_address: {{address: {host}, port_value: {port}}}"""


def overriding_cluster(
    name: str, endpoints: list[tuple[str, int]], upstream_pool: str, namespace: str, header: str
) -> str:
    """The workers' cluster under ``override_host``: the picker's list (its ``envoy.lb``
    metadata) is tried in order; the endpoint that served goes back into ``envoy.lb``."""
    hosts = "\n".join(_ENDPOINT.format(host=h, port=int(p)) for h, p in endpoints)
    return _CLUSTER.format(
        name=name,
        upstream_pool=upstream_pool,
        namespace=namespace,
        header=header,
        served=SERVED_KEY,
        endpoints=hosts,
    )
