"""The Envoy bootstrap that ``fastroute epp --print-envoy-config`` prints.

One listener (``--envoy-listen-port``) with an HTTP connection manager whose filter chain is
ext_proc (to the picker at 127.0.0.1:``--grpc-port`` over HTTP/2) then the router, and one
ORIGINAL_DST cluster that sends each request to the address in the
``x-gateway-destination-endpoint`` header the picker set. The ext_proc processing mode asks
for what the picker needs and no more: the request headers, the request body buffered (model,
tokens, the DP rank spliced into it), and the response trailers. Trailers come only when the
response has some (Envoy 1.40 synthesises none for an HTTP/1.1 worker), but asking for them keeps
the ext_proc stream open until the response ends; Envoy closes the stream when the HTTP stream is
done (complete, reset, client gone), which is where the picker releases the lease, with no
message per streamed chunk. When a pick needs no body the picker answers the headers and
overrides the mode so that Envoy skips the body (``allow_mode_override``). Streams are not
timed out by Envoy (route timeout 0): the router's own ``--request-timeout-secs`` bounds a
lease.
"""

from __future__ import annotations

HEADER = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"
EPP_CLUSTER = "fastroute_epp"
ENDPOINTS_CLUSTER = "fastroute_endpoints"
# The largest request body Envoy buffers for the picker (larger ones get 413 from Envoy).
BODY_LIMIT = 32 * 1024 * 1024

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
          route_config:
            name: fastroute_routes
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route:
                  cluster: {endpoints}
                  timeout: 0s
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{cluster_name: {epp}}}
                timeout: {message_timeout}s
              failure_mode_allow: false
              allow_mode_override: true
              message_timeout: {message_timeout}s
              processing_mode:
                request_header_mode: SEND
                request_body_mode: BUFFERED
                request_trailer_mode: SKIP
                response_header_mode: SKIP
                response_body_mode: NONE
                response_trailer_mode: SEND
              metadata_options:
                receiving_namespaces:
                  untyped: ["{namespace}"]
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
          http2_protocol_options: {{}}
    load_assignment:
      cluster_name: {epp}
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {{address: 127.0.0.1, port_value: {grpc}}}
  - name: {endpoints}
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 5s
    original_dst_lb_config:
      use_http_header: true
      http_header_name: {header}
"""


def envoy_bootstrap(
    grpc_port: int,
    listen_port: int,
    admin_port: int | None = None,
    *,
    listen_host: str = "0.0.0.0",
    message_timeout: float = 10.0,
    idle_timeout: float = 1800.0,
) -> str:
    """The bootstrap YAML (see module docstring). ``message_timeout``: how long Envoy waits for
    one answer of the picker (a request queued by --max-concurrent-requests waits in it);
    ``idle_timeout``: Envoy's stream idle timeout (the router's request timeout)."""
    admin = _ADMIN.format(admin=int(admin_port)) if admin_port is not None else ""
    return _TEMPLATE.format(
        admin=admin,
        listen_host=listen_host,
        listen=int(listen_port),
        grpc=int(grpc_port),
        epp=EPP_CLUSTER,
        endpoints=ENDPOINTS_CLUSTER,
        header=HEADER,
        namespace=METADATA_NAMESPACE,
        body_limit=BODY_LIMIT,
        message_timeout=_secs(message_timeout),
        idle=_secs(idle_timeout),
    )


def _secs(value: float) -> str:
    text = ("%.3f" % float(value)).rstrip("0").rstrip(".")
    return text or "0"
