import shutil

from sluice_proto import generate as protogen


def test_generated_stubs_are_current():
    """Fails when a .proto changed without `make proto`."""
    assert protogen.stale_files() == []


def test_a_changed_proto_is_detected_as_stale(tmp_path, monkeypatch):
    proto_root = tmp_path / "proto"
    shutil.copytree(protogen.PROTO_ROOT, proto_root)
    monkeypatch.setattr(protogen, "PROTO_ROOT", proto_root)
    common = proto_root / protogen.PACKAGE / "common.proto"
    common.write_text(
        common.read_text().replace("string detail = 2;", "string detail = 2;\n  int64 since = 4;")
    )
    assert "common_pb2.py" in protogen.stale_files()


def test_generated_code_imports():
    from sluice_proto import common_pb2

    reply = common_pb2.HealthReply(state=common_pb2.HealthReply.SERVING)
    assert common_pb2.HealthReply.FromString(reply.SerializeToString()).state == reply.state
