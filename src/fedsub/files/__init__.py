"""The files a run reads and writes: atomic writes, the run folder and its lock, tensor files
(safetensors) and JSON values. Nothing here knows about models or algorithms."""
