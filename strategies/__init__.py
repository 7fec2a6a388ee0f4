"""Memory-saving training strategies (MemFerry, MPress), each written once against ``xpu``."""
