"""t1async's vLLM worker extension (t1async_vllm.py): a directory put on the vLLM server's PYTHONPATH."""

__all__: list[str] = []  # t1async_vllm.py is imported by vLLM, as a top-level module, never from here
