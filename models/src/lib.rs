//! Llama and Qwen2 model modules built on kiln's fused ops, with safetensors/GGUF loading and
//! generation. Not written yet: the foundation issue only reserves the crate.
