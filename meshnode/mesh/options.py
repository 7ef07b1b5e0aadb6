"""`meshnode dynamo-worker`'s flags (nothing of Dynamo or ZeroMQ imported: the command line is built without them)."""


def add_args(p) -> None:
    p.add_argument("--node", required=True, help="the node's client endpoint")
    p.add_argument("--kv-events", help="the node's --kv-events endpoint, relayed to Dynamo's KV router")
    p.add_argument("--namespace", default="mesh", help="Dynamo namespace of the endpoint (default mesh)")
    p.add_argument("--component", default="meshnode", help="Dynamo component of the endpoint (default meshnode)")
    p.add_argument("--model-name", help="the model's name in Dynamo (default: the node's file name)")
    p.add_argument("--hf-folder", help="the Hugging Face tokenizer folder Dynamo's frontend tokenizes with, written "
                   "there from the node's GGUF when it holds none (default: none: registered without model assets, "
                   "for a KvRouter)")
    p.add_argument("--discovery-backend", default="file", choices=("file", "etcd", "kubernetes", "mem"),
                   help="Dynamo's discovery (default file: DYN_FILE_KV names the folder)")
    p.add_argument("--curve-server-key", help="the node's public certificate, for a CURVE node")
    p.add_argument("--curve-client-cert", help="this worker's secret certificate, for a CURVE node")
