"""kvpush.daemon"""
