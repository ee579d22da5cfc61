"""Generated protobuf/gRPC code for the kvferry.v1 API (see proto/)."""
