"""An OTLP/HTTP traces receiver for tests, built on the official OTLP
protobuf definitions (PyPI `opentelemetry-proto`): decodes each
`POST /v1/traces` as an ExportTraceServiceRequest and prints one JSON line
per span (trace_id, span_id, parent_span_id, name, kind, status code,
attributes, service name), answering an empty ExportTraceServiceResponse.
Prints "port <port>" first. Run with .otel/venv (scripts/prepare.sh).
"""
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
            self.send_response(400)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        request = ExportTraceServiceRequest.FromString(body)
        for rs in request.resource_spans:
            service = {a.key: value(a.value) for a in rs.resource.attributes}.get("service.name")
            for ss in rs.scope_spans:
                for span in ss.spans:
                    print(json.dumps({
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(),
                        "name": span.name,
                        "kind": span.kind,
                        "status": span.status.code,
                        "attributes": {a.key: value(a.value) for a in span.attributes},
                        "service": service,
                    }), flush=True)
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(f"port {server.server_address[1]}", flush=True)
server.serve_forever()
