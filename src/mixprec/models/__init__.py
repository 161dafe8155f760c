"""mixprec.models"""
