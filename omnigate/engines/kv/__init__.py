"""Slot key/value caches and the decoder-stack forward over them, shared by the engines that batch streams."""
