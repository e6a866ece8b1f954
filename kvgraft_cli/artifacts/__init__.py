"""The ``.kvg`` artifact format: the canonical payload (safetensors with a fixed header) and its file frame. The only place that parses ``.kvg`` bytes."""
