"""Meshes of nodes under existing distributed engines (NVIDIA Dynamo): workers that are clients of a node."""
