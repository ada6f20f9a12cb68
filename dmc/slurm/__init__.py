"""SLURM launches: sweep files, job chains, sbatch rendering and submission."""
