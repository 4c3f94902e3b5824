"""Model files, tokenizer, the numpy reference forward pass and the ONNX graph builder."""
