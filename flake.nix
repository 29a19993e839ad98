{
  # Untested: written where Nix is not available (see README, "Nix"). The dev shell gives Python and
  # a virtualenv that pip fills from pyproject.toml; the package expects nixpkgs to provide mlx and
  # mlx-lm (python3Packages.mlx exists for darwin; mlx-lm may need an overlay).
  description = "exo: distributed LLM inference on MLX with native MTP speculative decoding";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-unstable";

  outputs = { self, nixpkgs }:
    let
      systems = [ "aarch64-darwin" "x86_64-linux" "aarch64-linux" ];
      forAll = f: nixpkgs.lib.genAttrs systems (system: f nixpkgs.legacyPackages.${system});
    in {
      devShells = forAll (pkgs: {
        default = pkgs.mkShell {
          packages = [ pkgs.python311 pkgs.git ];
          shellHook = ''
            [ -d .venv ] || python3 -m venv .venv
            . .venv/bin/activate
            pip install -q -e ".[dev]"
          '';
        };
      });

      packages = forAll (pkgs: {
        default = pkgs.python311Packages.buildPythonApplication {
          pname = "exo";
          version = "0.1.0";
          pyproject = true;
          src = ./.;
          build-system = [ pkgs.python311Packages.setuptools ];
          dependencies = with pkgs.python311Packages; [
            mlx mlx-lm pydantic safetensors tokenizers transformers huggingface-hub numpy
          ];
          doCheck = false;
        };
      });
    };
}
