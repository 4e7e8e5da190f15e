"""kvpush.engine_plugin"""
