"""A zero-logic ext_proc service over gRPC: grpcio's own cost per decision.

It answers every ``Process`` stream with the messages ``fastroute epp`` sends for a pick made on
the request headers (the destination header, ``envoy.lb`` metadata and the same processing-mode
override, built once) and continues every later message, without reading anything but which
message came. Run behind the bootstrap ``fastroute epp --print-envoy-config`` prints, its CPU
per decision is the floor grpcio sets for the picker: what a stream costs with no pick, no
booking and no admission. ``bench/epp.py`` runs it as the ``envoy+grpcstub`` row.

Usage: ``python bench/epp_grpc_stub.py PORT ENDPOINT [--sync]`` (ENDPOINT: ``ip:port`` to
route to; ``--sync``: grpcio's thread-pool server instead of grpc.aio, for comparison).
"""

from __future__ import annotations

import argparse
from concurrent import futures
from typing import Any

import grpc
import uvloop
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEADER = "x-gateway-destination-endpoint"


def answers(endpoint: str) -> dict[str, Any]:
    """The answer to each kind of ProcessingRequest."""
    dest = base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=HEADER, raw_value=endpoint.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )
    meta = struct_pb2.Struct()
    meta.get_or_create_struct("envoy.lb")[HEADER] = endpoint
    mode = ProcessingMode(
        request_header_mode=ProcessingMode.SEND,
        request_body_mode=ProcessingMode.NONE,
        request_trailer_mode=ProcessingMode.SKIP,
        response_header_mode=ProcessingMode.SEND,
        response_body_mode=ProcessingMode.NONE,
        response_trailer_mode=ProcessingMode.SEND,
    )
    routed = pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[dest]))
        ),
        dynamic_metadata=meta,
        mode_override=mode,
    )
    return {
        "request_headers": routed,
        "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
        "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
        "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
        "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
        "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
    }


def handler(fn: Any) -> Any:
    method = grpc.stream_stream_rpc_method_handler(
        fn,
        request_deserializer=pb.ProcessingRequest.FromString,
        response_serializer=pb.ProcessingResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(SERVICE, {"Process": method})


async def serve_aio(port: int, reply: dict[str, Any]) -> None:
    async def process(requests: Any, context: Any) -> None:
        while True:
            msg = await context.read()
            if msg is grpc.aio.EOF:
                return
            await context.write(reply[msg.WhichOneof("request")])

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler(process),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def serve_sync(port: int, reply: dict[str, Any]) -> None:
    def process(requests: Any, context: Any) -> Any:
        for msg in requests:
            yield reply[msg.WhichOneof("request")]

    # one thread per open stream: Envoy holds one per request in flight
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1024))
    server.add_generic_rpc_handlers((handler(process),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("port", type=int)
    ap.add_argument("endpoint", help="ip:port every request is routed to")
    ap.add_argument("--sync", action="store_true", help="grpcio's thread-pool server instead of grpc.aio")
    args = ap.parse_args()
    reply = answers(args.endpoint)
    if args.sync:
        serve_sync(args.port, reply)
    else:
        uvloop.run(serve_aio(args.port, reply))


if __name__ == "__main__":
    main()
