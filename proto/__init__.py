"""kvpush.proto"""
