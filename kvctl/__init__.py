"""kvctl: the operator tool for kvcached nodes."""
