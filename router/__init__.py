"""Router: public gRPC API, validation, tokenization, admission and routing (built in a later issue)."""
