"""Generated from proto/podresources/ by scripts/gen_proto.py. Never edited by hand."""
