"""The standard gRPC services every Coalesce server runs: health (Check, Watch and List) and server reflection
(v1 and v1alpha), which serves the coalesce.v1 files with their source comments so that `grpcurl describe`
shows the field documentation.

grpcio-health-checking's servicer has no List and grpcio-reflection ships v1alpha only, and serves files
rebuilt from the descriptor pool (comments lost): the two classes below add what is missing. The v1 and
v1alpha reflection protocols are the same messages under another package name, so one servicer answers both.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer

# Written by scripts/gen_protos.py: every coalesce.v1 file and its imports, with source info.
DESCRIPTOR_SET = Path(__file__).resolve().parent.parent / "protos" / "coalesce" / "v1" / "descriptors.binpb"
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_V1ALPHA = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


class Health(HealthServicer):
    """grpc.health.v1.Health with List: every service this server has a status for."""

    def __init__(self) -> None:
        super().__init__()
        self._listed = {"": health_pb2.HealthCheckResponse.SERVING}
        self._final = False  # after the graceful shutdown began, statuses no longer change

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        await super().set(service, status)
        if not self._final:
            self._listed[service] = status

    async def enter_graceful_shutdown(self) -> None:
        self._final = True
        self._listed = dict.fromkeys(self._listed, health_pb2.HealthCheckResponse.NOT_SERVING)
        await super().enter_graceful_shutdown()

    async def List(self, request: health_pb2.HealthListRequest, context: Any) -> health_pb2.HealthListResponse:
        listed = {name: health_pb2.HealthCheckResponse(status=status) for name, status in self._listed.items()}
        return health_pb2.HealthListResponse(statuses=listed)


def _renamed(proto: descriptor_pb2.FileDescriptorProto, name: str, package: str) -> descriptor_pb2.FileDescriptorProto:
    """The same (flat) file under another name and package: reflection v1 from v1alpha."""
    old, new = f".{proto.package}.", f".{package}."
    out = descriptor_pb2.FileDescriptorProto()
    out.CopyFrom(proto)
    out.name, out.package = name, package
    out.ClearField("options")
    for message in out.message_type:
        for field in message.field:
            if field.type_name:  # set only for message and enum fields
                field.type_name = field.type_name.replace(old, new, 1)
    for method in (m for service in out.service for m in service.method):
        method.input_type = method.input_type.replace(old, new, 1)
        method.output_type = method.output_type.replace(old, new, 1)
    return out


def _add(file: FileDescriptor, files: dict[str, descriptor_pb2.FileDescriptorProto]) -> None:
    """`file` after its imports (the order a pool needs), unless it is there already."""
    for dependency in file.dependencies:
        _add(dependency, files)
    if file.name not in files:
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        files[file.name] = proto


def _files() -> list[descriptor_pb2.FileDescriptorProto]:
    """Every file reflection may serve: ours with their comments; health and reflection's own; and the
    google.rpc error details, so that clients like grpcurl can print an error's details."""
    ours = descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTOR_SET.read_bytes()).file
    files = {proto.name: proto for proto in ours}
    for module in (health_pb2, reflection_pb2, error_details_pb2):
        _add(module.DESCRIPTOR, files)
    v1 = _renamed(files[reflection_pb2.DESCRIPTOR.name], "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1")
    return [*files.values(), v1]


class Reflection(ReflectionServicer):
    """Server reflection that answers with the files as protoc wrote them (source comments included)."""

    def __init__(self, service_names: Iterable[str]) -> None:
        files = _files()
        pool = descriptor_pool.DescriptorPool()
        for proto in files:
            pool.Add(proto)
        self._files = pool
        self._serialized = {proto.name: proto.SerializeToString() for proto in files}
        super().__init__(service_names, pool=pool)

    def _file_by_filename(self, request: Any, filename: str) -> reflection_pb2.ServerReflectionResponse:
        try:
            return self._answer(request, self._files.FindFileByName(filename))
        except KeyError:
            return _not_found(request)

    def _file_containing_symbol(self, request: Any, name: str) -> reflection_pb2.ServerReflectionResponse:
        try:
            return self._answer(request, self._files.FindFileContainingSymbol(name))
        except KeyError:
            return _not_found(request)

    def _answer(self, request: Any, file: FileDescriptor) -> reflection_pb2.ServerReflectionResponse:
        """The file and everything it imports, as serialized FileDescriptorProtos."""
        seen: dict[str, FileDescriptor] = {}
        todo = [file]
        while todo:
            f = todo.pop()
            if f.name not in seen:
                seen[f.name] = f
                todo.extend(f.dependencies)
        found = reflection_pb2.FileDescriptorResponse(file_descriptor_proto=[self._serialized[n] for n in seen])
        return reflection_pb2.ServerReflectionResponse(file_descriptor_response=found, original_request=request)


def _not_found(request: Any) -> reflection_pb2.ServerReflectionResponse:
    code = grpc.StatusCode.NOT_FOUND
    error = reflection_pb2.ErrorResponse(error_code=code.value[0], error_message=code.value[1])
    return reflection_pb2.ServerReflectionResponse(error_response=error, original_request=request)


def add_standard_services(server: grpc.aio.Server, service_names: Iterable[str]) -> Health:
    """Add health and reflection (both versions) for `service_names`; returns the health servicer, whose
    statuses the caller sets ("" is the whole server)."""
    health = Health()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection = Reflection([*service_names, HEALTH, REFLECTION_V1, REFLECTION_V1ALPHA])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(reflection, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        reflection.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    handler = grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": v1})
    server.add_generic_rpc_handlers((handler,))
    return health
