"""mixprec.accelerator"""
