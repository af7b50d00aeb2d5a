"""Graph passes over exported ONNX models (pure functions ModelProto -> ModelProto)."""
