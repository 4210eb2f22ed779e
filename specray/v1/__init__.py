"""Generated protobuf / gRPC stubs (grpcio-tools, from protos/specray/v1); do not edit.

Regenerate with ``python -m grpc_tools.protoc -I protos --python_out=. --grpc_python_out=.
--pyi_out=. protos/specray/v1/*.proto``; tests/unit/test_protos.py checks they are current.
"""
