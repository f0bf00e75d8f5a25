"""Coalesce: rpc. What every gRPC server and client here shares, beyond the generated code: the message-size
limit, the standard services (health with List, reflection serving the described protos) and tolerant
decoding of requests that do not parse."""
