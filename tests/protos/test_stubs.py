"""The committed stubs are exactly what `protos/generate.py` produces, they import as a package, and
every contract element carries a comment."""

from __future__ import annotations

import importlib

import pytest

from deepinfer.protos import generate

grpc_tools = pytest.importorskip("grpc_tools")

SERVICES = {
    "entrypoint": ("Entrypoint", {"Generate": True, "Abort": False, "Health": False}),
    "prefill": ("Prefill", {"Prefill": False, "Abort": False, "Health": False, "Drain": False}),
    "vision": ("Vision", {"Encode": False, "Release": False, "Abort": False, "Health": False, "Drain": False}),
    "decode": ("Decode", {"Reserve": False, "Start": True, "Abort": False, "Health": False, "Drain": False}),
    "loadbalancer": (
        "LoadBalancer",
        {"Register": False, "Heartbeat": False, "Pick": False, "Deregister": False, "ListInstances": False},
    ),
}
"""proto module -> (service, {method: is server streaming})."""


def _committed_stubs() -> dict[str, bytes]:
    return {
        p.name: p.read_bytes()
        for p in generate.PROTOS_DIR.iterdir()
        if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))
    }


def test_committed_stubs_match_regeneration(tmp_path):
    fresh = {p.name: p.read_bytes() for p in generate.generate(tmp_path)}
    committed = _committed_stubs()
    assert sorted(fresh) == sorted(committed), "stale or missing stubs: run `python -m deepinfer.protos.generate`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stubs out of date: {stale}; run `python -m deepinfer.protos.generate` (with the pinned grpcio-tools)"


def test_every_proto_has_stubs():
    names = {p.stem for p in generate.proto_files()}
    assert names == {"common", "kv_transfer", *SERVICES}  # kv_transfer: messages only, no service
    committed = _committed_stubs()
    for name in names:
        assert {f"{name}_pb2.py", f"{name}_pb2.pyi", f"{name}_pb2_grpc.py"} <= set(committed)


@pytest.mark.parametrize("module", sorted(SERVICES))
def test_services_import_and_have_their_methods(module):
    pb2 = importlib.import_module(f"deepinfer.protos.{module}_pb2")
    pb2_grpc = importlib.import_module(f"deepinfer.protos.{module}_pb2_grpc")
    service_name, methods = SERVICES[module]
    service = pb2.DESCRIPTOR.services_by_name[service_name]
    assert service.full_name == f"deepinfer.v1.{service_name}"
    assert {m.name: m.server_streaming for m in service.methods} == methods
    assert not any(m.client_streaming for m in service.methods)
    assert hasattr(pb2_grpc, f"{service_name}Stub") and hasattr(pb2_grpc, f"{service_name}Servicer")


def _uncommented(f) -> list[str]:
    """Names of the elements of one FileDescriptorProto (with source info) that lack a leading comment."""
    commented = {tuple(loc.path) for loc in f.source_code_info.location if loc.leading_comments.strip()}
    missing = []

    def check(path, name):
        if tuple(path) not in commented:
            missing.append(f"{f.name}: {name}")

    def walk_enum(enum, path, prefix):
        check(path, prefix)
        for i, value in enumerate(enum.value):
            check([*path, 2, i], f"{prefix}.{value.name}")

    def walk_message(msg, path, prefix):
        check(path, prefix)
        for i, fld in enumerate(msg.field):
            check([*path, 2, i], f"{prefix}.{fld.name}")
        for i, nested in enumerate(msg.nested_type):
            if not nested.options.map_entry:
                walk_message(nested, [*path, 3, i], f"{prefix}.{nested.name}")
        for i, enum in enumerate(msg.enum_type):
            walk_enum(enum, [*path, 4, i], f"{prefix}.{enum.name}")

    for i, msg in enumerate(f.message_type):
        walk_message(msg, [4, i], msg.name)
    for i, enum in enumerate(f.enum_type):
        walk_enum(enum, [5, i], enum.name)
    for i, service in enumerate(f.service):
        check([6, i], service.name)
        for j, method in enumerate(service.method):
            check([6, i, 2, j], f"{service.name}.{method.name}")
    return missing


def test_every_element_is_commented(tmp_path):
    """Every message, field, enum, enum value, service and method has a leading comment."""
    import subprocess
    import sys

    from google.protobuf import descriptor_pb2

    out = tmp_path / "set.pb"
    # NOTE: protoc runs in a child process (see protos/generate.py: in-process it can segfault next to torch)
    with generate.include_root() as include:
        code = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{include}", "--include_source_info",
                               f"--descriptor_set_out={out}", *generate.proto_sources()], check=False,
                              cwd=include).returncode
    assert code == 0
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    assert sorted(f.name for f in fds.file) == sorted(generate.proto_sources())
    missing = []
    for f in fds.file:
        assert f.package == "deepinfer.v1", f.name
        missing += _uncommented(f)
    assert not missing, f"uncommented proto elements: {missing}"
