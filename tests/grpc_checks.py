"""Checks every Coalesce server shares: the standard gRPC services (health with List, reflection v1 and
v1alpha serving descriptors with their comments). Plain functions over a sync channel."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

HEALTH = "grpc.health.v1.Health"
REFLECTION = ("grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection")


def reflect(
    channel: grpc.Channel, version: str, *requests: reflection_pb2.ServerReflectionRequest
) -> list[reflection_pb2.ServerReflectionResponse]:
    """Answers of one ServerReflectionInfo call on `version` ("v1" or "v1alpha"); both versions have the same
    messages on the wire, so the v1alpha classes read v1 answers too."""
    call = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    return list(call(iter(requests), timeout=10))


def check_standard_services(channel: grpc.Channel, service: str) -> None:
    """Health/List names the server and `service` as SERVING; both reflection versions list every service
    and serve `service`'s file with its source comments."""
    statuses = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=10).statuses
    serving = health_pb2.HealthCheckResponse.SERVING
    assert statuses[""].status == serving and statuses[service].status == serving, statuses
    for version in ("v1", "v1alpha"):
        listed, found = reflect(
            channel,
            version,
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=service),
        )
        names = {s.name for s in listed.list_services_response.service}
        assert {service, HEALTH, *REFLECTION} <= names, names
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in found.file_descriptor_response.file_descriptor_proto]  # fmt: skip
        (home,) = [f for f in files if any(f"{f.package}.{s.name}" == service for s in f.service)]
        comments = [loc.leading_comments for loc in home.source_code_info.location if loc.leading_comments]
        assert comments, f"{home.name} is served without its comments ({version})"
