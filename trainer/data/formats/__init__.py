"""On-disk dataset formats: ImageFolder, FFCV .beton files (read and write), the embedded digit scans."""
